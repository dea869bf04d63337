//! Connection settings.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use nvme_auth::DhchapKey;
use nvme_auth::tls::ConfiguredPsk;

use crate::{Error, HostIdentity};

/// The conventional NVMe-oF I/O port.
pub const DEFAULT_PORT: u16 = 4420;
/// The conventional NVMe-oF discovery port.
pub const DEFAULT_DISCOVERY_PORT: u16 = 8009;

/// An NVMe-oF transport.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// NVMe/TCP.
    #[default]
    Tcp,
    /// NVMe/RDMA (RoCE v2, InfiniBand, iWARP) through RDMA-CM; needs rdma-core (libibverbs,
    /// librdmacm) and an RDMA device at run time.
    Rdma,
}

impl Transport {
    /// The name nvme-cli uses (`tcp`, `rdma`).
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        }
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Transport {
    type Err = Error;

    /// `tcp` or `rdma` (case-insensitive).
    fn from_str(s: &str) -> Result<Self, Error> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Transport::Tcp),
            "rdma" => Ok(Transport::Rdma),
            _ => Err(Error::InvalidArgument(format!(
                "transport {s:?} is not supported (tcp or rdma)"
            ))),
        }
    }
}

/// A target's transport address: transport, host name or IP address, and port.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TargetAddr {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    /// Port (the transport service ID: a TCP port, or the RDMA-CM port space's port).
    pub port: u16,
    /// Transport.
    pub transport: Transport,
}

impl TargetAddr {
    /// An NVMe/TCP address from a host and a port.
    pub fn new(host: impl Into<String>, port: u16) -> Self {
        let host: String = host.into();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .map(str::to_string)
            .unwrap_or(host);
        TargetAddr {
            host,
            port,
            transport: Transport::Tcp,
        }
    }

    /// An NVMe/RDMA address from a host (an IP address of an RDMA device) and a port.
    pub fn rdma(host: impl Into<String>, port: u16) -> Self {
        TargetAddr::new(host, port).with_transport(Transport::Rdma)
    }

    /// The same address over another transport.
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }
}

impl fmt::Display for TargetAddr {
    /// `HOST:PORT` for NVMe/TCP, `rdma://HOST:PORT` for NVMe/RDMA.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.transport == Transport::Rdma {
            f.write_str("rdma://")?;
        }
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl FromStr for TargetAddr {
    type Err = Error;

    /// Parses `HOST:PORT`, `[IPV6]:PORT`, or a bare host (port 4420), optionally prefixed
    /// with `tcp://` or `rdma://`.
    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some(rest) = s.strip_prefix("rdma://") {
            return Ok(rest.parse::<TargetAddr>()?.with_transport(Transport::Rdma));
        }
        let s = s.strip_prefix("tcp://").unwrap_or(s);
        let bad = || Error::InvalidArgument(format!("{s:?} is not HOST:PORT"));
        if let Some(rest) = s.strip_prefix('[') {
            let (host, tail) = rest.split_once(']').ok_or_else(bad)?;
            let port = match tail.strip_prefix(':') {
                Some(p) => p.parse().map_err(|_| bad())?,
                None if tail.is_empty() => DEFAULT_PORT,
                None => return Err(bad()),
            };
            return Ok(TargetAddr::new(host, port));
        }
        match s.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => {
                Ok(TargetAddr::new(h, p.parse().map_err(|_| bad())?))
            }
            _ if !s.is_empty() => Ok(TargetAddr::new(s, DEFAULT_PORT)),
            _ => Err(bad()),
        }
    }
}

/// How I/O commands pick an I/O queue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueuePolicy {
    /// Each thread sticks to one queue (threads are spread over the queues in the order they
    /// first submit). No shared counter is touched per I/O.
    #[default]
    PerThread,
    /// Every command goes to the next queue in turn.
    RoundRobin,
}

/// When and how long to reconnect after a connection is lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReconnectPolicy {
    /// Delay before the first reconnect attempt; doubled after each failed attempt.
    pub initial_delay: Duration,
    /// Upper bound of the delay between attempts.
    pub max_delay: Duration,
    /// Give up (the controller fails and pending commands get an error) when the controller
    /// could not be reconnected for this long. `None`: never give up.
    pub ctrl_loss_timeout: Option<Duration>,
}

impl Default for ReconnectPolicy {
    fn default() -> Self {
        ReconnectPolicy {
            initial_delay: Duration::from_millis(250),
            max_delay: Duration::from_secs(10),
            ctrl_loss_timeout: Some(Duration::from_secs(600)),
        }
    }
}

impl ReconnectPolicy {
    /// No reconnect: the first connection loss fails the controller.
    pub fn never() -> Self {
        ReconnectPolicy {
            initial_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            ctrl_loss_timeout: Some(Duration::ZERO),
        }
    }
}

/// Timeouts. Every wait of the initiator is bounded by one of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Opening the TCP connection and receiving the ICResp (NVMe/RDMA: resolving the address
    /// and route and the RDMA-CM connection).
    pub connect: Duration,
    /// Each admin command (Connect, Property Get/Set, Identify, Get Log Page, Keep Alive…).
    pub admin: Duration,
    /// Each I/O command, from the moment it is handed to its queue until it completes
    /// (including time spent waiting for room among the queue's entries, for a reconnect and
    /// for a retry). Commands handed over together, before the queue next writes, share one
    /// clock reading: the first one's.
    pub io: Duration,
    /// Waiting for CSTS.SHST after a shutdown request at disconnect.
    pub shutdown: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(10),
            admin: Duration::from_secs(10),
            io: Duration::from_secs(30),
            shutdown: Duration::from_secs(5),
        }
    }
}

/// DH-HMAC-CHAP secrets for in-band authentication, in nvme-cli's `DHHC-1:XX:<base64>:`
/// format. `Debug` shows no key material.
#[derive(Clone, Debug)]
pub struct DhchapSecrets {
    /// The host's secret (`--dhchap-secret`): the host proves it holds it whenever the
    /// controller asks for authentication.
    pub host: DhchapKey,
    /// The controller's secret (`--dhchap-ctrl-secret`): with it the host also asks the
    /// controller to prove it holds it (bidirectional authentication).
    pub ctrl: Option<DhchapKey>,
}

impl DhchapSecrets {
    /// Parses the host secret and the optional controller secret. The error names which
    /// secret is malformed, never its content.
    pub fn parse(host: &str, ctrl: Option<&str>) -> Result<Self, Error> {
        let parse = |which: &str, s: &str| {
            DhchapKey::parse(s).map_err(|e| Error::InvalidArgument(format!("{which}: {e}")))
        };
        Ok(DhchapSecrets {
            host: parse("DH-HMAC-CHAP host secret", host)?,
            ctrl: ctrl
                .map(|c| parse("DH-HMAC-CHAP controller secret", c))
                .transpose()?,
        })
    }
}

/// Settings of a connection to an NVM subsystem.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Target address.
    pub addr: TargetAddr,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Host identity.
    pub host: HostIdentity,
    /// Number of I/O queues to ask for; `None` = one per available core. The target may grant
    /// fewer. 0 makes an admin-only connection.
    pub io_queues: Option<u16>,
    /// I/O queues to ask for on top of `io_queues`, kept for run-to-completion
    /// [`QueuePair`](crate::QueuePair)s (each takes one; default 0). The target may grant
    /// fewer.
    pub queue_pairs: u16,
    /// Entries per I/O queue to ask for; the controller's CAP.MQES + 1 caps it. One entry is
    /// kept free, so `queue_depth - 1` commands are on the wire per queue at most; a queue
    /// takes twice that many at once, the others waiting in the queue for room.
    pub queue_depth: u16,
    /// Keep alive timeout asked for at Connect; Keep Alive is sent every half of it.
    pub kato: Duration,
    /// Ask for NVMe/TCP header digests (not available over NVMe/RDMA).
    pub header_digest: bool,
    /// Ask for NVMe/TCP data digests (not available over NVMe/RDMA).
    pub data_digest: bool,
    /// Ask the controller at each queue's Fabrics Connect to disable SQ flow control
    /// (Connect attribute bit 2, as the Linux host does when a discovery log entry allows
    /// it): the controller then reports no submission queue head, and an NVMe/TCP controller
    /// may end a successful read with its last data PDU (the SUCCESS flag) instead of a
    /// response capsule, one PDU fewer per read at both ends. On by default; a controller that
    /// refuses the admin queue's Connect with the attribute set is connected again without
    /// it. [`ControllerInfo::sq_flow_control`](crate::ControllerInfo::sq_flow_control) tells
    /// which is in force.
    pub disable_sq_flow_control: bool,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Reconnect behaviour.
    pub reconnect: ReconnectPolicy,
    /// Retry writes (Write, Write Zeroes, Dataset Management) that were in flight when a
    /// connection was lost. Off by default: such a write may already have been applied, and
    /// replaying it later could overwrite newer data written by someone else. Reads and
    /// flushes are always retried.
    pub retry_writes: bool,
    /// Largest transfer per command in bytes, on top of the controller's MDTS (`None`: the
    /// MDTS, or 1 MiB when the controller reports no limit).
    pub max_transfer: Option<u32>,
    /// Queue selection for I/O.
    pub queue_policy: QueuePolicy,
    /// Busy-poll window of each I/O queue: after submitting or receiving, a queue keeps
    /// checking its connection for this long before it sleeps, so a completion is picked up
    /// without a wake-up from idle (lower latency; costs CPU while I/O flows). After a
    /// submission it always polls the window for the answer; after an arrival only while
    /// completions come back within the window ([`busy_poll::PollGate`]), so sparse I/O costs
    /// at most one window per submission and an idle queue no CPU. An async caller that
    /// waits for one answer at a time (its command the only one in flight on its queue, and
    /// no second one lately), on a thread where no other queue received data lately, reads
    /// the socket itself in a loop for its answer from its second look on (plain NVMe/TCP,
    /// [`busy_poll::SPIN_MAX`] at most at a time) instead of yielding to the runtime between
    /// looks; nothing else runs on its thread meanwhile. Default [`DEFAULT_BUSY_POLL`]; zero = purely event-driven.
    pub busy_poll: Duration,
    /// Poll window of the GPU request rings a queue serves (`Controller::attach_gpu_rings`):
    /// after the last request taken or completion written, the queue keeps checking its rings
    /// without sleeping for this long, then on a timer ladder up to 1 ms. A GPU thread that
    /// submits its next read within the window (after copying and using the last one) is
    /// picked up at once; later, it may wait up to about 1 ms. Costs a core per active queue
    /// while the window is open; idle rings cost no spinning. Default [`DEFAULT_RING_POLL`];
    /// zero = the ladder only.
    pub ring_poll: Duration,
    /// DH-HMAC-CHAP secrets, used on every queue whose controller asks for authentication.
    /// `None`: a controller that requires authentication is refused with [`Error::Auth`].
    pub dhchap: Option<DhchapSecrets>,
    /// NVMe/TCP over TLS 1.3 with a pre-shared key: every queue's connection starts with a
    /// TLS handshake ([`Error::Tls`] when it fails). `None`: plain TCP.
    pub tls: Option<TlsOptions>,
}

/// The TLS PSK of a connection, from nvme-cli's `NVMeTLSkey-1:01:<base64>:` configured PSK
/// (`nvme gen-tls-key`). `Debug` shows no key material.
#[derive(Clone, Debug)]
pub struct TlsOptions {
    /// The configured PSK (`--tls-key`); the TLS PSK and its identity are derived from it for
    /// the host and subsystem NQNs.
    pub psk: ConfiguredPsk,
    /// The PSK identity version: 0 (`NVMe0R01 <hostnqn> <subnqn>`, what `nvme check-tls-key
    /// --insert` inserts by default) or 1 (`NVMe1R01 ... <digest>`).
    pub identity_version: u8,
}

impl TlsOptions {
    /// Parses a configured PSK in the interchange format, with identity version 0. The
    /// error never shows the key.
    pub fn parse(psk: &str) -> Result<Self, Error> {
        let psk = ConfiguredPsk::parse(psk)
            .map_err(|e| Error::InvalidArgument(format!("TLS PSK: {e}")))?;
        nvmf_tls::check_psk_hash(psk.cipher_hash())
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        Ok(TlsOptions {
            psk,
            identity_version: 0,
        })
    }
}

/// The default busy-poll window of an I/O queue ([`ConnectOptions::busy_poll`]).
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_micros(50);

/// The default poll window of GPU request rings ([`ConnectOptions::ring_poll`]): as long as
/// the timer's granularity, so a thread that comes back within it never waits for the timer.
pub const DEFAULT_RING_POLL: Duration = Duration::from_millis(1);

impl ConnectOptions {
    /// Settings with the defaults: one I/O queue per core, 128 entries, KATO 5 s, no digests.
    pub fn new(addr: TargetAddr, subnqn: impl Into<String>, host: HostIdentity) -> Self {
        ConnectOptions {
            addr,
            subnqn: subnqn.into(),
            host,
            io_queues: None,
            queue_pairs: 0,
            queue_depth: 128,
            kato: Duration::from_secs(5),
            header_digest: false,
            data_digest: false,
            disable_sq_flow_control: true,
            timeouts: Timeouts::default(),
            reconnect: ReconnectPolicy::default(),
            retry_writes: false,
            max_transfer: None,
            queue_policy: QueuePolicy::default(),
            busy_poll: DEFAULT_BUSY_POLL,
            ring_poll: DEFAULT_RING_POLL,
            dhchap: None,
            tls: None,
        }
    }

    pub(crate) fn wanted_io_queues(&self) -> u16 {
        match self.io_queues {
            Some(n) => n,
            None => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(usize::from(u16::MAX - 1)) as u16,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if !crate::identity::valid_nqn(&self.subnqn) {
            return Err(Error::InvalidArgument(format!(
                "{:?} is not a valid subsystem NQN",
                self.subnqn
            )));
        }
        if self.queue_depth < 2 {
            return Err(Error::InvalidArgument(
                "queue depth must be at least 2".into(),
            ));
        }
        if self.io_queues == Some(u16::MAX) {
            return Err(Error::InvalidArgument("too many I/O queues".into()));
        }
        if self.kato.as_millis() > u128::from(u32::MAX) {
            return Err(Error::InvalidArgument(
                "keep alive timeout too large".into(),
            ));
        }
        if self.addr.transport == Transport::Rdma && (self.header_digest || self.data_digest) {
            return Err(Error::InvalidArgument(
                "digests are an NVMe/TCP feature; NVMe/RDMA has none".into(),
            ));
        }
        if let Some(m) = self.max_transfer {
            if m < 512 {
                return Err(Error::InvalidArgument(
                    "max transfer must be at least 512 bytes".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Settings of a discovery request.
#[derive(Clone, Debug)]
pub struct DiscoveryOptions {
    /// Discovery controller address (conventionally port 8009, but any I/O port of most
    /// targets answers too).
    pub addr: TargetAddr,
    /// Host identity (targets filter the log by host NQN).
    pub host: HostIdentity,
    /// Ask for header digests.
    pub header_digest: bool,
    /// Ask for data digests.
    pub data_digest: bool,
    /// Timeouts (connect and admin apply).
    pub timeouts: Timeouts,
    /// Attempts to read a consistent log (the generation counter must not change while the
    /// entries are read).
    pub max_attempts: u32,
}

impl DiscoveryOptions {
    /// Default settings for `addr`.
    pub fn new(addr: TargetAddr, host: HostIdentity) -> Self {
        DiscoveryOptions {
            addr,
            host,
            header_digest: false,
            data_digest: false,
            timeouts: Timeouts::default(),
            max_attempts: 10,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_addresses() {
        let a: TargetAddr = "127.0.0.1:4421".parse().unwrap();
        assert_eq!(a, TargetAddr::new("127.0.0.1", 4421));
        let a: TargetAddr = "[::1]:9".parse().unwrap();
        assert_eq!(a.host, "::1");
        assert_eq!(a.to_string(), "[::1]:9");
        let a: TargetAddr = "example.com".parse().unwrap();
        assert_eq!(a.port, DEFAULT_PORT);
        assert!("host:notaport".parse::<TargetAddr>().is_err());
        assert!("".parse::<TargetAddr>().is_err());
        assert_eq!(TargetAddr::new("[fe80::1]", 1).host, "fe80::1");
        let r: TargetAddr = "rdma://10.0.0.1:4421".parse().unwrap();
        assert_eq!(r, TargetAddr::rdma("10.0.0.1", 4421));
        assert_eq!(r.to_string(), "rdma://10.0.0.1:4421");
        assert_eq!(
            "rdma://[::1]".parse::<TargetAddr>().unwrap().port,
            DEFAULT_PORT
        );
        let t: TargetAddr = "tcp://h:1".parse().unwrap();
        assert_eq!(t.transport, Transport::Tcp);
        assert!("rdma://".parse::<TargetAddr>().is_err());
        assert_eq!("RDMA".parse::<Transport>().unwrap(), Transport::Rdma);
        assert!("fc".parse::<Transport>().is_err());
    }
}
