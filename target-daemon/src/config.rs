//! The daemon's configuration: a TOML file, quick-start flags, and the embedded default.
//!
//! ```toml
//! [target]
//! reactors = 2                      # data-plane threads (default: one per core, or per CPU of `cpus`)
//! cpus = "0-1"                      # pin reactor N to the Nth of these CPUs (default: unpinned)
//! poll_us = 50                      # busy-poll window after activity (default 50; 0: event-driven)
//! handshake_timeout = "5s"          # ICReq and Fabrics Connect must be done within this
//! max_connections = 16384           # open connections on the whole target
//! max_connections_per_listener = 4096
//! auth_rate = 8                     # DH-HMAC-CHAP exchanges per second per host NQN and address
//! auth_burst = 64                   # ... and at once (auth_rate = 0: no limit)
//! control_socket = "/run/nvmeof/targetd.sock"  # nvmeof-targetd ctl (default shown)
//! control_group = "nvmeof"          # may use the control socket besides root
//! save_dir = "/etc/nvmeof"          # where `ctl save` may write (default: the --config file's directory)
//! state_dir = "/var/lib/nvmeof"     # where reservations persist through power loss (PTPL)
//!
//! [target.remote_control]            # the control requests over TCP with mutual TLS (off unless set)
//! listen = "0.0.0.0:4480"
//! cert = "/etc/nvmeof/remote/target.pem"
//! key = "/etc/nvmeof/remote/target.key"
//! ca = "/etc/nvmeof/remote/ca.pem"  # client certificates must be signed by it
//! admins = ["csi-controller"]       # client certificate CNs that may change the target
//! readers = ["monitoring"]          # ... that may only list and status
//!
//! [[listener]]
//! address = "tcp://0.0.0.0:4420"
//!
//! [[listener]]
//! address = "tcp://0.0.0.0:4421"
//! tls = "required"                  # TLS 1.3 with a PSK (hosts with a tls_psk); plain TCP refused
//! ana = [{ group = 1, state = "non-optimized" }]  # ANA states here (default: optimized)
//!
//! [discovery]
//! listen = ["tcp://0.0.0.0:8009"]   # dedicated discovery listeners (also served on every I/O listener)
//! referrals = ["tcp://192.0.2.20:8009"]  # other discovery controllers, listed in the discovery log
//! mdns = true                       # advertise the discovery listeners over mDNS (_nvme-disc._tcp)
//!
//! [[subsystem]]
//! nqn = "nqn.2026-11.io.nvmeof-direct:ssd0"
//! allow_any_host = false
//! hosts = ["nqn.2014-08.org.nvmexpress:uuid:..."]
//! cntlid_min = 1                    # controller IDs handed out (two targets of one subsystem:
//! cntlid_max = 999                  # disjoint ranges)
//!
//! [[subsystem.host]]                # a host that must authenticate (DH-HMAC-CHAP and/or TLS)
//! nqn = "nqn.2014-08.org.nvmexpress:uuid:..."
//! dhchap_key = "DHHC-1:01:...:"     # from `nvme gen-dhchap-key`
//! tls_psk = "NVMeTLSkey-1:01:...:"  # from `nvme gen-tls-key`: its TLS PSK on tls listeners
//! dhchap_ctrl_key = "DHHC-1:01:...:" # optional: the controller authenticates itself too
//! dhchap_hash = "hmac(sha384)"      # optional: the only hash allowed (default: any)
//! dhchap_dhgroup = "ffdhe3072"      # optional: the only DH group allowed (default: any)
//!
//! [[subsystem.namespace]]
//! backend = "file:/var/lib/nvmeof/ns1.img,size=10G"
//! hosts = ["nqn.2014-08.org.nvmexpress:uuid:..."]  # seen by these hosts only (default: all)
//! ana_group = 1                     # ANA group (default 1)
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use blockdev::BackendSpec;
use nvme_auth::tls::ConfiguredPsk;
use nvme_auth::{DhGroupId, DhchapKey, HashId};
use nvme_spec::log::AnaState;
use serde::{Deserialize, Serialize};

/// Highest ANA group ID (ANAGRPMAX) and number of groups (NANAGRPID), as Linux nvmet.
pub const MAX_ANA_GROUPS: u32 = 128;

/// Whether `group` is a valid ANA group ID here.
pub fn valid_group(group: u32) -> bool {
    (1..=MAX_ANA_GROUPS).contains(&group)
}

/// NQN of the subsystem served when no configuration is given.
pub const DEFAULT_NQN: &str = "nqn.2026-11.io.nvmeof-direct:default";
/// Listener used when no configuration is given.
pub const DEFAULT_LISTEN: &str = "tcp://127.0.0.1:4420";
/// Namespace used when no configuration is given.
pub const DEFAULT_NAMESPACE: &str = "mem:1G";
/// The control socket when none is configured.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/nvmeof/targetd.sock";

/// Configuration errors, each with a one-line explanation.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML did not parse or did not match the schema.
    #[error("invalid config: {0}")]
    Toml(#[from] toml::de::Error),
    /// A semantic error.
    #[error("invalid config: {0}")]
    Invalid(String),
    /// A listener address that does not parse; the message names the address.
    #[error("{0}")]
    Address(String),
}

/// A transport address such as `tcp://127.0.0.1:4420` or `rdma://192.168.1.2:4420`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ListenAddr {
    /// Transport.
    pub transport: Transport,
    /// Socket address.
    pub addr: SocketAddr,
}

/// Transport kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// NVMe/TCP.
    Tcp,
    /// NVMe/RDMA.
    Rdma,
}

impl FromStr for ListenAddr {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |why: String| Err(ConfigError::Address(format!("listener {s:?}: {why}")));
        let (transport, rest) = if let Some(r) = s.strip_prefix("tcp://") {
            (Transport::Tcp, r)
        } else if let Some(r) = s.strip_prefix("rdma://") {
            (Transport::Rdma, r)
        } else {
            return bad("expected tcp://ADDR:PORT or rdma://ADDR:PORT".into());
        };
        // [IPv6]:PORT, or IPv4-or-name:PORT; a bare IPv6 address has more than one colon.
        let (host, port) = if let Some(r) = rest.strip_prefix('[') {
            match r.split_once(']') {
                Some((h, "")) => (h, None),
                Some((h, p)) => match p.strip_prefix(':') {
                    Some(p) => (h, Some(p)),
                    None => return bad(format!("expected :PORT after [{h}]")),
                },
                None => return bad("missing ] after the IPv6 address".into()),
            }
        } else if rest.matches(':').count() > 1 {
            return bad("an IPv6 address needs brackets: [ADDR]:PORT, e.g. [::1]:4420".into());
        } else {
            match rest.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (rest, None),
            }
        };
        let Some(port) = port else {
            return bad(format!(
                "the port is missing (NVMe/TCP and NVMe/RDMA use 4420, discovery 8009), \
                 e.g. {}{rest}:4420",
                &s[..s.len() - rest.len()]
            ));
        };
        let port = match port.parse::<u32>() {
            Ok(p) if p <= u32::from(u16::MAX) => p as u16,
            Ok(p) => return bad(format!("port {p} is out of range (at most 65535)")),
            Err(_) => return bad(format!("port {port:?} is not a number")),
        };
        let ip = match host.parse::<std::net::IpAddr>() {
            Ok(ip) => ip,
            Err(_) if host.is_empty() => {
                return bad(
                    "the address is missing (0.0.0.0 listens on every IPv4 address)".into(),
                );
            }
            Err(_) => {
                return bad(format!(
                    "{host:?} is not an IP address; a listener binds to an IP address of this \
                     machine (e.g. 127.0.0.1, 0.0.0.0, [::1] or [::])"
                ));
            }
        };
        Ok(ListenAddr {
            transport,
            addr: SocketAddr::new(ip, port),
        })
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = match self.transport {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        };
        write!(f, "{t}://{}", self.addr)
    }
}

impl Serialize for ListenAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ListenAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The whole configuration.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Daemon-wide settings.
    #[serde(default)]
    pub target: TargetSettings,
    /// I/O listeners (they also answer discovery).
    #[serde(default, rename = "listener")]
    pub listeners: Vec<ListenerConfig>,
    /// Dedicated discovery listeners.
    #[serde(default)]
    pub discovery: DiscoveryConfig,
    /// Exported subsystems.
    #[serde(default, rename = "subsystem")]
    pub subsystems: Vec<SubsystemConfig>,
}

/// Daemon-wide settings and limits.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TargetSettings {
    /// Data-plane threads; 0 = one per CPU of `cpus`, else one per available core.
    pub reactors: usize,
    /// CPUs to pin the reactors to, written like `"0-7"` or `"0,2,4-6"`: reactor N runs
    /// only on the Nth CPU of the list (wrapping around when there are more reactors than
    /// CPUs), as a poll-mode target's core mask does. Unset: the kernel places them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpus: Option<String>,
    /// Maximum I/O queues per controller.
    pub max_io_queues: u16,
    /// Maximum queue depth (entries) per queue.
    pub max_queue_depth: u16,
    /// Maximum data transfer size in KiB (a power of two, at least 4).
    pub mdts_kib: u32,
    /// In-capsule data accepted on I/O queues, in bytes.
    pub in_capsule_data: u32,
    /// Largest C2HData PDU payload in bytes.
    pub max_c2h_data: u32,
    /// Keep alive timeout granted when the host asks for none on an I/O controller, in ms.
    pub default_kato_ms: u32,
    /// After each receive, a reactor keeps polling its connections (NVMe/TCP and NVMe/RDMA)
    /// for this many microseconds instead of sleeping in the kernel, so the next command of a
    /// busy host is picked up without a wake-up; only while commands arrive densely enough for
    /// that to pay ([`busy_poll::PollGate`]). 0 = never poll (purely event-driven). An idle
    /// reactor sleeps either way.
    pub poll_us: u32,
    /// A connection must finish the transport handshake (NVMe/TCP ICReq, NVMe/RDMA queue
    /// pair set-up) and the Fabrics Connect within this time, else it is closed. Written like
    /// `"5s"` or `"500ms"` in the file.
    #[serde(
        deserialize_with = "deserialize_duration",
        serialize_with = "serialize_duration"
    )]
    pub handshake_timeout: Duration,
    /// Most connections open on the whole target; more are closed as soon as accepted.
    pub max_connections: usize,
    /// Most connections open on one listener; more are closed as soon as accepted.
    pub max_connections_per_listener: usize,
    /// Serve Prometheus metrics at `http://ADDR:PORT/metrics` (off unless set), written like
    /// `"127.0.0.1:9464"` in the file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<SocketAddr>,
    /// The control socket (`nvmeof-targetd ctl`); default [`DEFAULT_CONTROL_SOCKET`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control_socket: Option<PathBuf>,
    /// Group (name or ID) whose members may use the control socket besides root.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub control_group: Option<String>,
    /// The directory `nvmeof-targetd ctl save` may write to (default: the directory of the
    /// `--config` file; without one, saves are refused).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub save_dir: Option<PathBuf>,
    /// The directory where namespaces keep their reservations when a host turns Persist
    /// Through Power Loss on (without it, hosts cannot).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    /// DH-HMAC-CHAP transactions with a Diffie-Hellman exchange allowed per second to each
    /// host NQN and to each source address, after a burst of `auth_burst`; 0 = no limit.
    pub auth_rate: u32,
    /// Such transactions allowed at once to each host NQN and each source address.
    pub auth_burst: u32,
    /// The memory all connections together may hold in send backlogs, receive buffers and
    /// data buffers, in bytes (written like `"1G"` or `"512M"` in the file; at least 16M).
    /// A connection over it stops reading its socket until others give memory back
    /// ([`crate::memory`]).
    #[serde(
        deserialize_with = "deserialize_size",
        serialize_with = "serialize_size"
    )]
    pub memory_budget: u64,
    /// The remote control API (`[target.remote_control]`): the control requests over TCP
    /// with mutual TLS. Off unless set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote_control: Option<RemoteControl>,
}

/// The remote control API's settings ([`crate::remote`]).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteControl {
    /// The TCP address to serve on, written like `"0.0.0.0:4480"`.
    pub listen: SocketAddr,
    /// The target's certificate (PEM; intermediate certificates may follow).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA certificates (PEM) a client's certificate must be signed by.
    pub ca: PathBuf,
    /// Client certificate common names (CN) that may make every request.
    #[serde(default)]
    pub admins: Vec<String>,
    /// Client certificate common names that may only read (`list`, `status`).
    #[serde(default)]
    pub readers: Vec<String>,
}

/// The default daemon-wide memory budget (`memory_budget`): 1 GiB.
pub const DEFAULT_MEMORY_BUDGET: u64 = 1 << 30;

/// The default busy-poll window of a reactor, in microseconds (`poll_us`).
pub const DEFAULT_POLL_US: u32 = 50;

/// The highest CPU number a `cpus` list may name.
pub const MAX_CPU: usize = 4095;

/// Parses a CPU list like `"0-7"` or `"0,2,4-6"` into CPU numbers, in the order written and
/// without repeats. Errors name what is wrong in one line.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>, String> {
    let mut cpus: Vec<usize> = Vec::new();
    for part in list.split(',').map(str::trim) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let num = |v: &str| {
            v.trim()
                .parse::<usize>()
                .ok()
                .filter(|&c| c <= MAX_CPU)
                .ok_or_else(|| {
                    format!("{part:?} in {list:?}: expected CPU numbers 0-{MAX_CPU}, like 0-7 or 0,2,4-6")
                })
        };
        let (a, b) = (num(a)?, num(b)?);
        if a > b {
            return Err(format!(
                "{part:?} in {list:?}: a range runs upwards, like 4-6"
            ));
        }
        for c in a..=b {
            if cpus.contains(&c) {
                return Err(format!("CPU {c} is named twice in {list:?}"));
            }
            cpus.push(c);
        }
    }
    Ok(cpus)
}

impl Default for TargetSettings {
    fn default() -> Self {
        TargetSettings {
            reactors: 0,
            cpus: None,
            max_io_queues: 64,
            max_queue_depth: 128,
            mdts_kib: 1024,
            in_capsule_data: 8192,
            max_c2h_data: 128 * 1024,
            default_kato_ms: 120_000,
            poll_us: DEFAULT_POLL_US,
            handshake_timeout: Duration::from_secs(5),
            max_connections: 16384,
            max_connections_per_listener: 4096,
            metrics: None,
            control_socket: None,
            control_group: None,
            save_dir: None,
            state_dir: None,
            auth_rate: 8,
            auth_burst: 64,
            memory_budget: DEFAULT_MEMORY_BUDGET,
            remote_control: None,
        }
    }
}

/// One listener.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// `tcp://ADDR:PORT` or `rdma://ADDR:PORT`.
    pub address: ListenAddr,
    /// `tls = "required"`: every connection starts with a TLS 1.3 handshake with the PSK of
    /// a `[[subsystem.host]]` that has a `tls_psk` (NVMe/TCP only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsRequirement>,
    /// The Asymmetric Namespace Access state of ANA groups on this listener
    /// (`ana = [{ group = 1, state = "inaccessible" }]`); groups not listed are optimized.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ana: Vec<AnaGroupState>,
}

/// The ANA state of one ANA group on a listener.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AnaGroupState {
    /// ANA group ID (1..=[`MAX_ANA_GROUPS`]).
    pub group: u32,
    /// `optimized`, `non-optimized`, `inaccessible`, `persistent-loss` or `change`.
    #[serde(
        serialize_with = "serialize_ana_state",
        deserialize_with = "deserialize_ana_state"
    )]
    pub state: AnaState,
}

fn serialize_ana_state<S: serde::Serializer>(a: &AnaState, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(a.name())
}

fn deserialize_ana_state<'de, D: serde::Deserializer<'de>>(d: D) -> Result<AnaState, D::Error> {
    String::deserialize(d)?
        .parse()
        .map_err(serde::de::Error::custom)
}

/// The TLS requirement of a listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsRequirement {
    /// TLS 1.3 with a PSK, plain connections refused.
    Required,
}

/// Discovery settings.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Dedicated discovery listeners (conventionally port 8009).
    #[serde(default)]
    pub listen: Vec<ListenAddr>,
    /// Other discovery controllers, each listed in the discovery log as a referral entry
    /// (hosts that follow referrals read their logs too).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub referrals: Vec<ListenAddr>,
    /// Advertise every discovery listener over mDNS (DNS-SD service `_nvme-disc._tcp`,
    /// NVMe TP 8009), so that hosts on the link find them without being told.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mdns: bool,
}

/// One subsystem.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    /// The subsystem NQN.
    pub nqn: String,
    /// Serial number (default: derived from the NQN, stable across restarts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    /// Model number.
    #[serde(default = "default_model")]
    pub model: String,
    /// Accept any host NQN.
    #[serde(default)]
    pub allow_any_host: bool,
    /// Host NQNs allowed to connect (when `allow_any_host` is false).
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Hosts allowed to connect that must authenticate with DH-HMAC-CHAP or hold a TLS PSK
    /// (`[[subsystem.host]]` tables).
    #[serde(default, rename = "host")]
    pub auth_hosts: Vec<HostAuthConfig>,
    /// Namespaces, NSIDs assigned in order from 1 unless given.
    #[serde(default, rename = "namespace")]
    pub namespaces: Vec<NamespaceConfig>,
    /// Lowest controller ID handed out (default 1). Two targets serving one subsystem (an
    /// active/standby or active/active pair) give their controllers disjoint ranges.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cntlid_min: Option<u16>,
    /// Highest controller ID handed out (default FFEFh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cntlid_max: Option<u16>,
}

/// A host that authenticates with DH-HMAC-CHAP, or with a TLS PSK on TLS listeners, before
/// it may use the subsystem.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HostAuthConfig {
    /// The host NQN.
    pub nqn: String,
    /// The host's secret, `DHHC-1:XX:<base64>:` as `nvme gen-dhchap-key` writes it: with it
    /// the host must authenticate in band (DH-HMAC-CHAP).
    #[serde(
        default,
        deserialize_with = "deserialize_opt_key",
        serialize_with = "serialize_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub dhchap_key: Option<DhchapKey>,
    /// The configured TLS PSK, `NVMeTLSkey-1:01:<base64>:` as `nvme gen-tls-key` writes it:
    /// the host's TLS PSK and identity on `tls = "required"` listeners are derived from it.
    #[serde(
        default,
        deserialize_with = "deserialize_psk",
        serialize_with = "serialize_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_psk: Option<ConfiguredPsk>,
    /// The controller's secret: with it the controller authenticates itself to the host when
    /// the host asks (bidirectional authentication).
    #[serde(
        default,
        deserialize_with = "deserialize_opt_key",
        serialize_with = "serialize_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub dhchap_ctrl_key: Option<DhchapKey>,
    /// The only hash function this host may use, `hmac(sha256)`, `hmac(sha384)` or
    /// `hmac(sha512)` (default: any, SHA-256 preferred).
    #[serde(
        default,
        deserialize_with = "deserialize_hash",
        serialize_with = "serialize_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub dhchap_hash: Option<HashId>,
    /// The only DH group this host may use, `null` or `ffdhe2048` ... `ffdhe8192` (default:
    /// any, ffdhe2048 preferred, null last).
    #[serde(
        default,
        deserialize_with = "deserialize_dhgroup",
        serialize_with = "serialize_text",
        skip_serializing_if = "Option::is_none"
    )]
    pub dhchap_dhgroup: Option<DhGroupId>,
}

fn deserialize_hash<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<HashId>, D::Error> {
    let s = String::deserialize(d)?;
    HashId::ALL
        .into_iter()
        .find(|h| h.name() == s || h.name().strip_prefix("hmac(") == Some(&format!("{s})")))
        .map(Some)
        .ok_or_else(|| {
            serde::de::Error::custom(format!(
                "dhchap_hash {s:?}: expected hmac(sha256), hmac(sha384) or hmac(sha512)"
            ))
        })
}

fn deserialize_dhgroup<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<DhGroupId>, D::Error> {
    let s = String::deserialize(d)?;
    DhGroupId::ALL
        .into_iter()
        .find(|g| g.name() == s)
        .map(Some)
        .ok_or_else(|| {
            serde::de::Error::custom(format!(
                "dhchap_dhgroup {s:?}: expected null, ffdhe2048, ffdhe3072, ffdhe4096, \
                 ffdhe6144 or ffdhe8192"
            ))
        })
}

fn deserialize_opt_key<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<DhchapKey>, D::Error> {
    DhchapKey::parse(&String::deserialize(d)?)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// Parses a configured TLS PSK (`NVMeTLSkey-1:XX:...:`) that the TLS listeners can use. The
/// error names what is wrong, never the key.
pub fn parse_tls_psk(s: &str) -> Result<ConfiguredPsk, String> {
    let psk = ConfiguredPsk::parse(s).map_err(|e| format!("tls_psk: {e}"))?;
    nvmf_tls::check_psk_hash(psk.cipher_hash()).map_err(|e| format!("tls_psk: {e}"))?;
    Ok(psk)
}

fn deserialize_psk<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<ConfiguredPsk>, D::Error> {
    parse_tls_psk(&String::deserialize(d)?)
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// How a key or a setting of a `[[subsystem.host]]` table is written in the file.
trait ConfigText {
    fn text(&self) -> String;
}

impl ConfigText for DhchapKey {
    fn text(&self) -> String {
        self.to_dhhc1()
    }
}

impl ConfigText for ConfiguredPsk {
    fn text(&self) -> String {
        self.to_interchange()
    }
}

impl ConfigText for HashId {
    fn text(&self) -> String {
        self.name().to_string()
    }
}

impl ConfigText for DhGroupId {
    fn text(&self) -> String {
        self.name().to_string()
    }
}

fn serialize_text<T: ConfigText, S: serde::Serializer>(
    v: &Option<T>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_str(&v.text()),
        None => s.serialize_none(),
    }
}

/// Highest controller ID a subsystem hands out (FFF0h and above are reserved).
pub const MAX_CNTLID: u16 = 0xFFEF;

/// The model number of a subsystem that names none.
pub const DEFAULT_MODEL: &str = "nvmeof-direct";

fn default_model() -> String {
    DEFAULT_MODEL.to_string()
}

/// One namespace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    /// Namespace ID (default: position + 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsid: Option<u32>,
    /// The backend: `mem:SIZE`, `null:SIZE`, `file:PATH[,size=SIZE]`, `bdev:PATH`,
    /// `pcie:DOMAIN:BUS:DEV.FN[,nsid=N]`.
    pub backend: BackendSpec,
    /// Namespace UUID override (default: derived from subsystem NQN and NSID).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// The only hosts (NQNs) that see the namespace; empty: every host the subsystem admits.
    /// Other hosts find it inactive: not in the active namespace list, a zeroed Identify
    /// Namespace, and Invalid Namespace for I/O.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// ANA group (default 1); changes only at a restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ana_group: Option<u32>,
}

impl SubsystemConfig {
    /// The NSID of each namespace, given or by position.
    pub fn nsids(&self) -> impl Iterator<Item = u32> + '_ {
        self.namespaces
            .iter()
            .enumerate()
            .map(|(i, ns)| ns.nsid.unwrap_or(i as u32 + 1))
    }
}

impl Config {
    /// Parses and validates a TOML document.
    pub fn from_toml(s: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(s)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads, parses and validates a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let s = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&s)
    }

    /// The configuration of the quick start: one subsystem, given listeners and namespaces.
    pub fn quick(
        listen: &[ListenAddr],
        nqn: &str,
        namespaces: &[BackendSpec],
        allow_any_host: bool,
        hosts: &[String],
    ) -> Result<Self, ConfigError> {
        let cfg = Config {
            target: TargetSettings::default(),
            listeners: listen
                .iter()
                .map(|a| ListenerConfig {
                    address: a.clone(),
                    tls: None,
                    ana: Vec::new(),
                })
                .collect(),
            discovery: DiscoveryConfig::default(),
            subsystems: vec![SubsystemConfig {
                nqn: nqn.to_string(),
                serial: None,
                model: default_model(),
                allow_any_host,
                hosts: hosts.to_vec(),
                auth_hosts: Vec::new(),
                namespaces: namespaces
                    .iter()
                    .map(|b| NamespaceConfig {
                        nsid: None,
                        backend: b.clone(),
                        uuid: None,
                        hosts: Vec::new(),
                        ana_group: None,
                    })
                    .collect(),
                cntlid_min: None,
                cntlid_max: None,
            }],
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The embedded default: a 1 GiB memory namespace on tcp://127.0.0.1:4420, any host.
    pub fn embedded_default() -> Self {
        let listen: ListenAddr = DEFAULT_LISTEN.parse().unwrap_or(ListenAddr {
            transport: Transport::Tcp,
            addr: SocketAddr::from(([127, 0, 0, 1], 4420)),
        });
        let ns: BackendSpec = DEFAULT_NAMESPACE.parse().unwrap_or(BackendSpec::Memory {
            size: 1 << 30,
            block_size: blockdev::DEFAULT_BLOCK_SIZE,
        });
        Config::quick(&[listen], DEFAULT_NQN, &[ns], true, &[]).unwrap_or_else(|_| Config {
            target: TargetSettings::default(),
            listeners: vec![],
            discovery: DiscoveryConfig::default(),
            subsystems: vec![],
        })
    }

    /// The same configuration with every NSID written out, so that removing a namespace never
    /// renumbers the ones after it.
    pub fn with_explicit_nsids(mut self) -> Self {
        for s in &mut self.subsystems {
            let ids: Vec<u32> = s.nsids().collect();
            for (ns, id) in s.namespaces.iter_mut().zip(ids) {
                ns.nsid = Some(id);
            }
        }
        self
    }

    /// The configuration as a TOML document that [`Config::from_toml`] reads back.
    pub fn to_toml(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|e| ConfigError::Invalid(format!("cannot write TOML: {e}")))
    }

    /// Checks cross-field rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.listeners.is_empty() && self.discovery.listen.is_empty() {
            return bad("no listener configured".into());
        }
        let t = &self.target;
        if let Some(r) = &t.remote_control {
            if r.admins.is_empty() && r.readers.is_empty() {
                return bad(
                    "target.remote_control: no client may use it: list identities in admins or readers"
                        .into(),
                );
            }
            if let Some(both) = r.admins.iter().find(|a| r.readers.contains(a)) {
                return bad(format!(
                    "target.remote_control: {both:?} is in both admins and readers"
                ));
            }
        }
        if let Some(list) = &t.cpus {
            parse_cpu_list(list).map_err(|m| ConfigError::Invalid(format!("target.cpus: {m}")))?;
        }
        if t.mdts_kib < 4 || !t.mdts_kib.is_power_of_two() || t.mdts_kib > 32 * 1024 {
            return bad(format!(
                "target.mdts_kib = {}: must be a power of two between 4 and 32768",
                t.mdts_kib
            ));
        }
        if t.max_queue_depth < 2 || t.max_queue_depth > 4096 {
            return bad(format!(
                "target.max_queue_depth = {}: must be 2..=4096",
                t.max_queue_depth
            ));
        }
        if t.max_io_queues == 0 || t.max_io_queues > 1024 {
            return bad(format!(
                "target.max_io_queues = {}: must be 1..=1024",
                t.max_io_queues
            ));
        }
        if t.in_capsule_data % 16 != 0 || t.in_capsule_data > 1 << 20 {
            return bad(format!(
                "target.in_capsule_data = {}: must be a multiple of 16, at most 1 MiB",
                t.in_capsule_data
            ));
        }
        if t.max_c2h_data < 4096 || t.max_c2h_data % 4 != 0 {
            return bad(format!(
                "target.max_c2h_data = {}: must be >= 4096 and a multiple of 4",
                t.max_c2h_data
            ));
        }
        if t.handshake_timeout.is_zero() || t.handshake_timeout > Duration::from_secs(3600) {
            return bad(format!(
                "target.handshake_timeout = {}ms: must be more than 0 and at most 1h",
                t.handshake_timeout.as_millis()
            ));
        }
        if t.memory_budget < crate::memory::MIN_MEMORY_BUDGET {
            return bad(format!(
                "target.memory_budget = {}: must be at least 16M",
                blockdev::format_size(t.memory_budget)
            ));
        }
        if t.max_connections == 0 || t.max_connections_per_listener == 0 {
            return bad(
                "target.max_connections and max_connections_per_listener must be at least 1".into(),
            );
        }
        for l in &self.listeners {
            if l.tls.is_some() && l.address.transport != Transport::Tcp {
                return bad(format!(
                    "listener {}: tls is for NVMe/TCP listeners only",
                    l.address
                ));
            }
            let mut groups = std::collections::HashSet::new();
            for a in &l.ana {
                if !valid_group(a.group) {
                    return bad(format!(
                        "listener {}: ANA group {}: must be 1..={}",
                        l.address, a.group, MAX_ANA_GROUPS
                    ));
                }
                if !groups.insert(a.group) {
                    return bad(format!(
                        "listener {}: ANA group {} is listed twice",
                        l.address, a.group
                    ));
                }
            }
        }
        for d in &self.discovery.listen {
            if d.addr.port() == 0 {
                continue;
            }
            if let Some(l) = self.listeners.iter().find(|l| l.address == *d) {
                return bad(format!(
                    "discovery listener {d} is the same address as listener {}, which serves \
                     discovery too: remove it from [discovery] listen",
                    l.address
                ));
            }
        }
        let mut referrals = std::collections::HashSet::new();
        for r in &self.discovery.referrals {
            if r.addr.port() == 0 || r.addr.ip().is_unspecified() {
                return bad(format!(
                    "discovery referral {r}: a referral names the address and port of another \
                     discovery controller (e.g. tcp://192.0.2.20:8009)"
                ));
            }
            if !referrals.insert(r) {
                return bad(format!("discovery referral {r} is listed twice"));
            }
        }
        let mut nqns = std::collections::HashSet::new();
        for s in &self.subsystems {
            if let Some(why) = nqn_problem(&s.nqn) {
                return bad(format!("subsystem nqn {:?}: {why}", s.nqn));
            }
            if s.nqn == nvme_spec::fabrics::DISCOVERY_NQN {
                return bad("the discovery NQN cannot be used for a subsystem".into());
            }
            if !nqns.insert(&s.nqn) {
                return bad(format!("subsystem {} is defined twice", s.nqn));
            }
            if !s.allow_any_host && s.hosts.is_empty() && s.auth_hosts.is_empty() {
                return bad(format!(
                    "subsystem {}: no host may connect (set allow_any_host = true or list hosts)",
                    s.nqn
                ));
            }
            let mut seen = std::collections::HashSet::new();
            for h in s.hosts.iter().chain(s.auth_hosts.iter().map(|a| &a.nqn)) {
                if let Some(why) = nqn_problem(h) {
                    return bad(format!("subsystem {}: host NQN {h:?}: {why}", s.nqn));
                }
                if !seen.insert(h) {
                    return bad(format!(
                        "subsystem {}: host {h} is listed twice (a host with a dhchap_key \
                         belongs in [[subsystem.host]] only)",
                        s.nqn
                    ));
                }
            }
            for h in &s.auth_hosts {
                let dhchap_extras = h.dhchap_ctrl_key.is_some()
                    || h.dhchap_hash.is_some()
                    || h.dhchap_dhgroup.is_some();
                if h.dhchap_key.is_none() && (h.tls_psk.is_none() || dhchap_extras) {
                    return bad(format!(
                        "subsystem {}: host {}: needs a dhchap_key (DH-HMAC-CHAP settings \
                         need one too) or a tls_psk",
                        s.nqn, h.nqn
                    ));
                }
            }
            if s.model.len() > 40 {
                return bad(format!("subsystem {}: model longer than 40 bytes", s.nqn));
            }
            if let Some(sn) = &s.serial {
                if sn.len() > 20 || !sn.is_ascii() {
                    return bad(format!(
                        "subsystem {}: serial must be ASCII, at most 20 bytes",
                        s.nqn
                    ));
                }
            }
            let mut ids = std::collections::HashSet::new();
            for (i, ns) in s.namespaces.iter().enumerate() {
                let id = ns.nsid.unwrap_or(i as u32 + 1);
                if id == 0 || id == u32::MAX {
                    return bad(format!("subsystem {}: invalid nsid {id}", s.nqn));
                }
                if !ids.insert(id) {
                    return bad(format!("subsystem {}: nsid {id} used twice", s.nqn));
                }
                if let Some(u) = &ns.uuid {
                    if parse_uuid(u).is_none() {
                        return bad(format!("subsystem {}: invalid uuid {u:?}", s.nqn));
                    }
                }
                if let Some(g) = ns.ana_group.filter(|g| !valid_group(*g)) {
                    return bad(format!(
                        "subsystem {} namespace {id}: ana_group {g}: must be 1..={}",
                        s.nqn, MAX_ANA_GROUPS
                    ));
                }
                let mut seen = std::collections::HashSet::new();
                for h in &ns.hosts {
                    if let Some(why) = nqn_problem(h) {
                        return bad(format!(
                            "subsystem {} namespace {id}: host NQN {h:?}: {why}",
                            s.nqn
                        ));
                    }
                    if !seen.insert(h) {
                        return bad(format!(
                            "subsystem {} namespace {id}: host {h} is listed twice",
                            s.nqn
                        ));
                    }
                }
            }
            let (lo, hi) = (
                s.cntlid_min.unwrap_or(1),
                s.cntlid_max.unwrap_or(MAX_CNTLID),
            );
            if lo == 0 || hi > MAX_CNTLID || lo > hi {
                return bad(format!(
                    "subsystem {}: cntlid_min = {lo}, cntlid_max = {hi}: need \
                     1 <= cntlid_min <= cntlid_max <= {MAX_CNTLID}",
                    s.nqn
                ));
            }
        }
        Ok(())
    }
}

/// A warning when the file at `path` holds DH-HMAC-CHAP keys and users other than its owner
/// may read it; `None` when it is fine.
pub fn key_file_warning(path: &Path, cfg: &Config) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    if cfg.subsystems.iter().all(|s| s.auth_hosts.is_empty()) {
        return None;
    }
    let mode = std::fs::metadata(path).ok()?.permissions().mode();
    (mode & 0o077 != 0).then(|| {
        format!(
            "config file {} holds DH-HMAC-CHAP or TLS keys but is readable by group or others \
             (mode {:o}): chmod 600 it",
            path.display(),
            mode & 0o777
        )
    })
}

/// Writes `text` to `path` atomically and privately: into a new temporary file of a unique
/// name in the same directory (created exclusively, so a symlink or file already there is
/// never followed or reused; mode 0600, as the text may hold keys), synced, renamed over
/// `path`, then the directory synced. With `backup`, the file that was at `path` is first
/// copied the same way to `path` + `.bak`. Concurrent writers never fail each other: the last
/// rename wins.
pub fn write_private(path: &Path, text: &str, backup: bool) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Some(name) = path.file_name() else {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a file name",
        ));
    };
    if backup {
        match std::fs::read(path) {
            Ok(old) => {
                let mut bak = name.to_os_string();
                bak.push(".bak");
                replace_private(dir, &dir.join(bak), &old)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    replace_private(dir, path, text.as_bytes())
}

/// Writes `bytes` to a fresh 0600 temporary file in `dir` and renames it to `path`.
fn replace_private(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let mut attempt = 0;
    let (tmp, mut file) = loop {
        let tmp = dir.join(format!(
            ".{name}.{}.{:016x}.tmp",
            std::process::id(),
            rand::random::<u64>()
        ));
        // create_new: O_CREAT | O_EXCL, which never follows a symlink.
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
        {
            Ok(f) => break (tmp, f),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 16 => {
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    };
    let written = file
        .write_all(bytes)
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::File::open(dir).and_then(|d| d.sync_all())
}

/// Parses a duration written as a number and a unit: `500ms`, `5s`, `2m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("duration {s:?}: expected a number and a unit, like 5s or 500ms"))?;
    let ms = match unit.trim() {
        "ms" => Some(n),
        "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => {
            return Err(format!(
                "duration {s:?}: unit must be ms, s, m or h, like 5s or 500ms"
            ));
        }
    };
    ms.map(Duration::from_millis)
        .ok_or_else(|| format!("duration {s:?} is too long"))
}

fn serialize_size<S: serde::Serializer>(n: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&blockdev::format_size(*n))
}

fn deserialize_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d)? {
        Size::Bytes(n) => Ok(n),
        Size::Text(s) => blockdev::parse_size(&s).map_err(serde::de::Error::custom),
    }
}

fn serialize_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{}ms", d.as_millis()))
}

fn deserialize_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    parse_duration(&s).map_err(serde::de::Error::custom)
}

/// Whether `s` looks like an NQN (NVMe Base 2.0 section 4.5: "nqn." prefix, at most 223 bytes).
pub fn valid_nqn(s: &str) -> bool {
    nqn_problem(s).is_none()
}

/// What is wrong with `s` as an NQN, or `None` when it looks like one.
pub fn nqn_problem(s: &str) -> Option<String> {
    if !s.starts_with("nqn.") {
        Some("an NQN starts with \"nqn.\" (e.g. nqn.2026-11.com.example:disk1)".into())
    } else if let Some(c) = s
        .chars()
        .find(|c| c.is_whitespace() || c.is_ascii_control())
    {
        Some(format!("an NQN cannot contain {c:?}"))
    } else if !s.is_ascii() {
        Some("an NQN here must be ASCII".into())
    } else if s.len() > 223 {
        Some(format!("{} bytes long; an NQN is at most 223", s.len()))
    } else {
        None
    }
}

/// Parses a textual UUID (8-4-4-4-12 hex digits).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: String = s.chars().filter(|&c| c != '-').collect();
    if hex.len() != 32 || s.len() != 36 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_in_order_and_refuse_what_names_no_cpu_once() {
        assert_eq!(parse_cpu_list("0-3").unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(parse_cpu_list("8, 2,4-5").unwrap(), vec![8, 2, 4, 5]);
        for (list, why) in [
            ("", "expected CPU numbers"),
            ("a", "expected CPU numbers"),
            ("1-", "expected CPU numbers"),
            ("4096", "expected CPU numbers 0-4095"),
            ("5-3", "a range runs upwards"),
            ("0-2,2", "CPU 2 is named twice"),
        ] {
            let e = parse_cpu_list(list).unwrap_err();
            assert!(e.contains(why), "{list:?}: {e}");
        }
        let e = Config::from_toml(
            "[target]\ncpus = \"3-1\"\n[[listener]]\naddress = \"tcp://127.0.0.1:4420\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("target.cpus: \"3-1\" in \"3-1\": a range runs upwards"),
            "{e}"
        );
    }

    #[test]
    fn a_discovery_listener_on_an_io_listener_is_named() {
        let e = Config::from_toml(
            "[[listener]]\naddress = \"tcp://127.0.0.1:4420\"\n\
             [discovery]\nlisten = [\"tcp://127.0.0.1:4420\"]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(
                "discovery listener tcp://127.0.0.1:4420 is the same address as listener \
                 tcp://127.0.0.1:4420"
            ),
            "{e}"
        );
    }

    #[test]
    fn saves_are_private_atomic_and_never_follow_a_planted_link() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "victim").unwrap();
        // What an attacker or an earlier run may have left: a symlink and an open file at the
        // temporary names a fixed scheme would use, and a world-readable file in place.
        std::os::unix::fs::symlink(&victim, dir.path().join("t.tmp")).unwrap();
        std::os::unix::fs::symlink(&victim, dir.path().join("t.toml.tmp")).unwrap();
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_private(&path, "new", true).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "victim");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        let bak = dir.path().join("t.toml.bak");
        assert_eq!(std::fs::read_to_string(&bak).unwrap(), "old");
        for p in [&path, &bak] {
            let mode = std::fs::metadata(p).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{}", p.display());
        }
        // Many writers at once: every one succeeds, one of them wins whole, no temporary
        // file stays.
        let texts: Vec<String> = (0..16)
            .map(|i| format!("writer {i}\n").repeat(1000))
            .collect();
        std::thread::scope(|s| {
            for t in &texts {
                let path = &path;
                s.spawn(move || write_private(path, t, true).unwrap());
            }
        });
        assert!(texts.contains(&std::fs::read_to_string(&path).unwrap()));
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".tmp") && n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn host_tables_carry_keys_that_never_show() {
        let key = "DHHC-1:00:ZXhhbXBsZS1rZXktZm9yLXVuaXQtdGVzdHMtMzJieXR38mKy:";
        let doc = |host_key: &str, extra: &str| {
            format!(
                r#"
                [[listener]]
                address = "tcp://127.0.0.1:4420"
                [[subsystem]]
                nqn = "nqn.2026-11.io.nvmeof-direct:auth"
                hosts = ["nqn.2014-08.org.nvmexpress:uuid:2"]
                [[subsystem.host]]
                nqn = "nqn.2014-08.org.nvmexpress:uuid:1"
                dhchap_key = "{host_key}"
                {extra}
                "#
            )
        };
        let extra = format!(
            "dhchap_ctrl_key = \"{key}\"\ndhchap_hash = \"hmac(sha384)\"\n\
             dhchap_dhgroup = \"ffdhe3072\""
        );
        let c = Config::from_toml(&doc(key, &extra)).unwrap();
        let h = &c.subsystems[0].auth_hosts[0];
        assert_eq!(h.dhchap_key.as_ref().unwrap().to_dhhc1(), key);
        assert!(h.dhchap_ctrl_key.is_some());
        assert_eq!(h.dhchap_hash, Some(HashId::Sha384));
        assert_eq!(h.dhchap_dhgroup, Some(DhGroupId::Ffdhe3072));
        let e = Config::from_toml(&doc(key, "dhchap_dhgroup = \"ffdhe1024\""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("dhchap_dhgroup \"ffdhe1024\""), "{e}");
        assert!(
            !format!("{c:?}").contains(&key[10..30]),
            "keys are redacted"
        );
        let e = Config::from_toml(&doc(&key.replace("ZX", "ZY"), ""))
            .unwrap_err()
            .to_string();
        assert!(e.contains("CRC") && !e.contains(&key[10..30]), "{e}");
        let twice = doc(key, "").replace("uuid:2", "uuid:1");
        let e = Config::from_toml(&twice).unwrap_err().to_string();
        assert!(e.contains("listed twice"), "{e}");
    }

    #[test]
    fn tls_listeners_and_psks() {
        let psk = ConfiguredPsk::new(nvme_auth::Secret::new(vec![5; 32]), Some(HashId::Sha256))
            .unwrap()
            .to_interchange();
        let doc = |transport: &str, host: &str| {
            format!(
                r#"
                [[listener]]
                address = "{transport}://127.0.0.1:4421"
                tls = "required"
                [[subsystem]]
                nqn = "nqn.2026-11.io.nvmeof-direct:tls"
                [[subsystem.host]]
                nqn = "nqn.2014-08.org.nvmexpress:uuid:1"
                {host}
                "#
            )
        };
        let c = Config::from_toml(&doc("tcp", &format!("tls_psk = \"{psk}\""))).unwrap();
        assert_eq!(c.listeners[0].tls, Some(TlsRequirement::Required));
        // A saved configuration (`ctl save`) keeps every key and reads back the same.
        let dhchap = DhchapKey::generate(&mut rand::rng(), 32, None)
            .unwrap()
            .to_dhhc1();
        let full = Config::from_toml(&doc(
            "tcp",
            &format!(
                "tls_psk = \"{psk}\"\ndhchap_key = \"{dhchap}\"\ndhchap_ctrl_key = \"{dhchap}\"\n\
                 dhchap_hash = \"hmac(sha384)\"\ndhchap_dhgroup = \"ffdhe3072\""
            ),
        ))
        .unwrap();
        let saved = full.to_toml().unwrap();
        let again = Config::from_toml(&saved).unwrap();
        assert_eq!(again.subsystems, full.subsystems, "{saved}");
        assert_eq!(again.listeners, full.listeners, "{saved}");
        let h = &c.subsystems[0].auth_hosts[0];
        assert!(h.dhchap_key.is_none() && h.tls_psk.is_some());
        assert!(
            !format!("{c:?}").contains(&psk[16..40]),
            "keys are redacted"
        );
        let bad = |d: String, want: &str| {
            let e = Config::from_toml(&d).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        };
        bad(
            doc("rdma", &format!("tls_psk = \"{psk}\"")),
            "tls is for NVMe/TCP listeners only",
        );
        bad(doc("tcp", ""), "needs a dhchap_key");
        bad(
            doc("tcp", "dhchap_hash = \"hmac(sha256)\""),
            "needs a dhchap_key",
        );
        bad(
            doc(
                "tcp",
                &format!("tls_psk = \"{}\"", psk.replace("NVMe", "nvme")),
            ),
            "tls_psk: key is not in the NVMeTLSkey-1: format",
        );
        let sha384 = ConfiguredPsk::new(nvme_auth::Secret::new(vec![5; 48]), Some(HashId::Sha384))
            .unwrap()
            .to_interchange();
        bad(
            doc("tcp", &format!("tls_psk = \"{sha384}\"")),
            "only SHA-256",
        );
        bad(
            doc("tcp", "").replace("\"required\"", "\"optional\""),
            "unknown variant `optional`",
        );
    }

    #[test]
    fn default_is_valid() {
        let c = Config::embedded_default();
        assert_eq!(c.listeners.len(), 1);
        assert_eq!(c.subsystems[0].nqn, DEFAULT_NQN);
        assert!(c.subsystems[0].allow_any_host);
        c.validate().unwrap();
    }

    #[test]
    fn full_file() {
        let c = Config::from_toml(
            r#"
            [target]
            reactors = 2
            poll_us = 75
            handshake_timeout = "1500ms"
            max_connections = 100
            max_connections_per_listener = 10
            memory_budget = "512M"
            [[listener]]
            address = "tcp://0.0.0.0:4420"
            [discovery]
            listen = ["tcp://127.0.0.1:8009"]
            [[subsystem]]
            nqn = "nqn.2026-11.io.example:a"
            hosts = ["nqn.2014-08.org.nvmexpress:uuid:1"]
            [[subsystem.namespace]]
            backend = "mem:64M"
            [[subsystem.namespace]]
            nsid = 7
            backend = "null:1G"
            uuid = "01234567-89ab-cdef-0123-456789abcdef"
            "#,
        )
        .unwrap();
        assert_eq!(c.target.reactors, 2);
        assert_eq!(c.target.poll_us, 75);
        assert_eq!(c.target.handshake_timeout, Duration::from_millis(1500));
        assert_eq!(c.target.max_connections, 100);
        assert_eq!(c.target.max_connections_per_listener, 10);
        assert_eq!(c.target.memory_budget, 512 << 20);
        assert_eq!(c.subsystems[0].namespaces[1].nsid, Some(7));
        // The budget saves as it was written and reads back; too small a budget is refused.
        let saved = toml::to_string(&c.target).unwrap();
        assert!(saved.contains("memory_budget = \"512M\""), "{saved}");
        let mut small = c.clone();
        small.target.memory_budget = 1 << 20;
        assert!(
            small
                .validate()
                .unwrap_err()
                .to_string()
                .contains("at least 16M")
        );
        assert_eq!(c.discovery.listen[0].addr.port(), 8009);
    }

    #[test]
    fn rejects_bad_input() {
        for (doc, needle) in [
            (
                "[[listener]]\naddress = \"udp://1.2.3.4:1\"",
                "expected tcp://",
            ),
            (
                "[[listener]]\naddress = \"tcp://x\"\n",
                "the port is missing",
            ),
            (
                "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[[subsystem]]\nnqn = \"bad\"\nallow_any_host = true",
                "starts with \"nqn.\"",
            ),
            (
                "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[[subsystem]]\nnqn = \"nqn.a\"",
                "no host may connect",
            ),
            (
                "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[target]\nmdts_kib = 3",
                "power of two",
            ),
            ("[bogus]\n", "unknown field"),
            (
                "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[target]\nhandshake_timeout = \"5\"",
                "unit must be",
            ),
            (
                "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[target]\nhandshake_timeout = \"0s\"",
                "more than 0",
            ),
            (
                "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[target]\nmax_connections = 0",
                "at least 1",
            ),
            (
                "[[listener]]\naddress = \"tcp://127.0.0.1:1\"\n[[subsystem]]\nnqn = \"nqn.a b\"\nallow_any_host = true",
                "an NQN cannot contain ' '",
            ),
        ] {
            let err = Config::from_toml(doc).unwrap_err().to_string();
            assert!(err.contains(needle), "{doc:?}: {err}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        for bad in [
            "",
            "s",
            "5",
            "5 sec",
            "-1s",
            "1.5s",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_example_configuration_is_valid_and_safe() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/nvmeof-targetd.toml");
        let c = Config::from_file(&path).unwrap();
        for l in &c.listeners {
            assert!(!l.address.addr.ip().is_unspecified(), "{}", l.address);
        }
        for s in &c.subsystems {
            assert!(!s.allow_any_host && !s.hosts.is_empty(), "{}", s.nqn);
            for ns in &s.namespaces {
                let size = match &ns.backend {
                    BackendSpec::Memory { size, .. } | BackendSpec::Null { size, .. } => *size,
                    BackendSpec::File(f) => f.create_size.unwrap_or(0),
                    BackendSpec::Bdev(_) | BackendSpec::Pcie { .. } => 0,
                };
                assert!(size <= 16 << 30, "{}", ns.backend);
            }
        }
    }

    /// The shipped unit lets the daemon write back the configuration file it starts from.
    #[test]
    fn the_unit_lets_the_daemon_write_its_configuration_directory() {
        let unit = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/nvmeof-targetd.service"),
        )
        .unwrap();
        let value = |key: &str| -> Vec<String> {
            unit.lines()
                .filter_map(|l| l.strip_prefix(key))
                .flat_map(|v| v.split_whitespace().map(str::to_string).collect::<Vec<_>>())
                .collect()
        };
        let exec = value("ExecStart=");
        let config = exec
            .iter()
            .skip_while(|a| *a != "--config")
            .nth(1)
            .expect("ExecStart names --config");
        let dir = Path::new(config).parent().unwrap().to_str().unwrap();
        assert!(value("ProtectSystem=").contains(&"strict".to_string()));
        assert!(
            value("ReadWritePaths=").iter().any(|p| p == dir),
            "ReadWritePaths lacks {dir}"
        );
    }

    #[test]
    fn listener_addresses() {
        for (ok, want) in [
            ("tcp://127.0.0.1:4420", "127.0.0.1:4420"),
            ("rdma://0.0.0.0:0", "0.0.0.0:0"),
            ("tcp://[::1]:8009", "[::1]:8009"),
        ] {
            let a: ListenAddr = ok.parse().unwrap();
            assert_eq!(a.addr.to_string(), want);
        }
        for (bad, needle) in [
            ("tcp://localhost:4420", "\"localhost\" is not an IP address"),
            ("tcp://127.0.0.1:99999", "port 99999 is out of range"),
            ("tcp://127.0.0.1", "the port is missing"),
            ("tcp://127.0.0.1:", "port \"\" is not a number"),
            ("tcp://[::1]", "the port is missing"),
            ("tcp://::1:4420", "needs brackets"),
            ("tcp://:4420", "the address is missing"),
            ("udp://1.2.3.4:1", "expected tcp://"),
        ] {
            let e = bad.parse::<ListenAddr>().unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
            assert!(!e.contains("IPv6 needs"), "{e}");
        }
    }

    #[test]
    fn uuid_parse() {
        assert_eq!(
            parse_uuid("01234567-89ab-cdef-0123-456789abcdef").unwrap()[..2],
            [0x01, 0x23]
        );
        assert!(parse_uuid("0123").is_none());
    }
}
