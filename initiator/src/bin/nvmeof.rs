//! `nvmeof`: discover, connect to, inspect, read and write NVMe-oF namespaces from user space,
//! and manage the named attachments held by `nvmeof-initd`.

use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use nvmeof_initiator::daemon::{
    self, AttachParams, AttachmentStatus, DaemonClient, KeyText, PathAddr,
};
use nvmeof_initiator::identity::{format_hostid, parse_hostid};
use nvmeof_initiator::nvme_spec::identify::{IdentifyController, IdentifyNamespace, get_trimmed};
use nvmeof_initiator::{
    ConnectOptions, Controller, ControllerState, DEFAULT_DISCOVERY_PORT, DEFAULT_PORT,
    DhchapSecrets, DiscoveryLog, DiscoveryOptions, HostIdentity, Multipath, MultipathOptions,
    Namespace, PathInfo, ReconnectPolicy, ReservationStatus, ResvAcquire, ResvRegister,
    ResvRelease, TargetAddr, TlsOptions, Transport, default_state_dir, discover,
    discover_referrals, hex_id, paths_from_discovery, version_string,
};
use serde_json::{Value, json};

const ABOUT: &str = "User-space NVMe over Fabrics (NVMe/TCP) initiator";

const LONG_ABOUT: &str = "\
User-space NVMe over Fabrics (NVMe/TCP) initiator.

Talks to NVMe-oF targets directly from user space (no kernel nvme-tcp module needed):
discover subsystems, connect and inspect controllers and namespaces, read and write blocks.
Lasting connections (attachments) are kept by the nvmeof-initd daemon; programs using the
nvmeof-initiator library open them by name and do their own I/O.

Flags follow nvme-cli: -t tcp -a ADDRESS -s PORT -n SUBSYSTEM-NQN, --hostnqn, --hostid,
-o json|normal. So do the command names: connect, connect-all, disconnect, disconnect-all
and list-subsys act on nvmeof-initd's attachments. In read and write, nvme-cli's -s (first
block) and -c/--block-count (a 0-based count) are refused with what to type instead:
--start-block LBA and --blocks N (the port is then --trsvcid).

Examples:
  nvmeof discover -t tcp -a 192.0.2.10 -s 4420
  nvmeof probe -t tcp -a 192.0.2.10 -s 4420 -n nqn.2026-11.io.nvmeof-direct:default
  nvmeof read -t tcp -a 192.0.2.10 --trsvcid 4420 -n NQN --namespace-id 1 \\
      --start-block 0 --blocks 256 --data blocks.bin
  nvmeof attach data0 -t tcp -a 192.0.2.10 -s 4420 -n NQN --namespace-id 1
  nvmeof connect -t tcp -a 192.0.2.10 -s 4420 -n NQN
  nvmeof list
  nvmeof read data0 --start-block 0 --blocks 8 --data - | hexdump -C

Exit status: 0 success, 1 other failure (local files, ...), 2 wrong usage (flags, ranges),
3 the target cannot be reached, refused the connection (authentication, TLS, host not
allowed) or the connection was lost, 4 the target answered with an NVMe error status,
5 nvmeof-initd cannot be reached or refused the request. A failure at the target counts
the same whether nvmeof-initd met it (attach, connect) or this command did.";

/// A mistake in the command line found after parsing.
#[derive(Debug)]
struct Usage(String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// Fails with a [`Usage`] error (exit status 2).
macro_rules! usage {
    ($($t:tt)*) => {
        return Err(anyhow::Error::new(Usage(format!($($t)*))))
    };
}

#[derive(Parser)]
#[command(name = "nvmeof", version, about = ABOUT, long_about = LONG_ABOUT)]
struct Cli {
    /// Output format: `normal` for people, `json` for programs (stable field names).
    #[arg(
        short = 'o',
        long = "output-format",
        value_enum,
        default_value = "normal",
        global = true
    )]
    output: Output,
    /// The nvmeof-initd socket (for attach, detach, list and attachment names). Default: for
    /// users other than root, their own daemon's $XDG_RUNTIME_DIR/nvmeof/initd.sock, then the
    /// system daemon's /run/nvmeof/initd.sock; for root, /run/nvmeof/initd.sock.
    #[arg(long, global = true, env = "NVMEOF_INITD_SOCKET", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Where the host identity is stored when /etc/nvme/hostnqn is absent
    /// (default: /var/lib/nvmeof for root, else ~/.local/state/nvmeof).
    #[arg(long, global = true, env = "NVMEOF_STATE_DIR", value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Log library activity (connects, reconnects) to stderr.
    #[arg(short = 'v', long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Normal,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Read the discovery log of a discovery controller.
    #[command(
        long_about = "Connects to the discovery controller at ADDRESS (port 8009 unless -s is \
given; the I/O port of most targets answers too), reads the whole discovery log and prints \
every entry: which subsystems this host may connect to, and where. With --referrals, the \
discovery controllers its referral entries name are read too, and theirs, down to --max-depth \
levels, each once. With --mdns, no address is needed: the discovery controllers that \
advertise themselves on the local link over mDNS (DNS-SD service _nvme-disc._tcp) are found \
first, then each is read."
    )]
    #[command(
        override_usage = "nvmeof discover -a ADDRESS [-s PORT] [OPTIONS]\n       nvmeof discover --mdns [OPTIONS]"
    )]
    Discover {
        #[command(flatten)]
        fabric: Fabric,
        /// Follow referral entries: read the logs of the discovery controllers they name.
        #[arg(long)]
        referrals: bool,
        /// Referral levels followed at most (with --referrals).
        #[arg(long = "max-depth", value_name = "N", default_value_t = nvmeof_initiator::DEFAULT_REFERRAL_DEPTH)]
        max_depth: u32,
        /// Find the discovery controllers advertised over mDNS (`_nvme-disc._tcp`) and read
        /// each (instead of -a).
        #[arg(long)]
        mdns: bool,
        /// Seconds to wait for mDNS answers (with --mdns).
        #[arg(long = "mdns-wait", value_name = "SECS", default_value_t = 2)]
        mdns_wait: u64,
    },
    /// Connect to a subsystem, print its controller and namespaces, disconnect.
    #[command(
        long_about = "A one-off look at a subsystem: sets up the admin queue and the I/O \
queues, prints what Identify Controller and Identify Namespace report, then disconnects \
gracefully. Nothing is kept: `connect` and `attach` make lasting connections.",
        override_usage = "nvmeof probe -a ADDRESS -n NQN [-s PORT] [OPTIONS]"
    )]
    Probe {
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
    },
    /// Attach the namespaces of a subsystem through nvmeof-initd (nvme-cli's connect).
    #[command(
        long_about = "nvme-cli's connect: asks nvmeof-initd to keep the subsystem's \
namespaces connected, each as an attachment named BASEn<NSID> (BASE: --name, or nvmeofK \
with the first K not in use), as nvme-cli names devices nvme0n1. Every active namespace \
is attached, or only --namespace-id. Namespaces attached already (same address, \
subsystem and namespace) are left as they are. If one attachment fails, those made by \
this command are taken back. `disconnect` ends them; `attach` gives one namespace a \
name of your own.",
        override_usage = "nvmeof connect -a ADDRESS -n NQN [-s PORT] [OPTIONS]"
    )]
    Connect {
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
        /// Attach only this namespace.
        #[arg(long = "namespace-id", value_name = "NSID")]
        namespace_id: Option<u32>,
        /// Base of the attachment names (default: nvmeofK, the first K not in use).
        #[arg(long = "name", value_name = "BASE")]
        name: Option<String>,
        /// Another path to the subsystem (repeat for more): ADDRESS or ADDRESS:PORT, an IPv6
        /// address in brackets (default port: -s, else 4420). The attachments are then multipath
        /// ones: `list` shows each path and its ANA states.
        #[arg(long = "path", value_name = "ADDRESS[:PORT]")]
        paths: Vec<String>,
    },
    /// Attach every subsystem a discovery controller lists (nvme-cli's connect-all).
    #[command(
        long_about = "nvme-cli's connect-all: reads the discovery log at ADDRESS (port 8009 \
unless -s is given) and connects (as `connect` does) to every NVM subsystem it lists. \
Subsystems connected already are left as they are. One that fails is reported and the \
others are still connected; the exit status is then that of the failure.",
        override_usage = "nvmeof connect-all -a ADDRESS [-s PORT] [OPTIONS]"
    )]
    ConnectAll {
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
    },
    /// Ask nvmeof-initd to keep a namespace connected under NAME.
    #[command(
        long_about = "Asks nvmeof-initd to connect to the subsystem and keep the connection \
alive (keep-alive, reconnect) under NAME. The attachment survives daemon restarts. Programs \
open it with nvmeof_initiator::open_attached(\"NAME\"); the CLI accepts NAME in place of \
-a/-s/-n.",
        override_usage = "nvmeof attach NAME -a ADDRESS -n NQN [-s PORT] [OPTIONS]"
    )]
    Attach {
        /// Attachment name (letters, digits, '.', '_', '-').
        name: String,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
        /// Namespace to attach.
        #[arg(long = "namespace-id", default_value_t = 1, value_name = "NSID")]
        namespace_id: u32,
        /// Another path to the subsystem (repeat for more): ADDRESS or ADDRESS:PORT, an IPv6
        /// address in brackets (default port: -s, else 4420). The attachment is then a multipath one:
        /// `list` shows each path and its ANA states.
        #[arg(long = "path", value_name = "ADDRESS[:PORT]")]
        paths: Vec<String>,
    },
    /// Remove an attachment from nvmeof-initd and disconnect it.
    Detach {
        /// Attachment name.
        name: String,
    },
    /// Detach the attachments of a subsystem, or one by name (nvme-cli's disconnect).
    #[command(
        long_about = "nvme-cli's disconnect: -n NQN detaches every attachment of that \
subsystem, -d NAME (or NAME alone) the attachment NAME.",
        override_usage = "nvmeof disconnect -n NQN | -d NAME | NAME [OPTIONS]"
    )]
    Disconnect {
        /// Attachment name (as -d).
        name: Option<String>,
        /// Detach every attachment of this subsystem.
        #[arg(short = 'n', long = "nqn", value_name = "NQN")]
        nqn: Option<String>,
        /// Detach this attachment.
        #[arg(short = 'd', long = "device", value_name = "NAME")]
        device: Option<String>,
    },
    /// Detach every attachment (nvme-cli's disconnect-all).
    DisconnectAll,
    /// List the attachments held by nvmeof-initd and their health.
    List,
    /// Connect to a subsystem over several paths, print each path and its ANA states,
    /// disconnect.
    #[command(
        long_about = "A one-off look at the paths to a subsystem, as the multipath layer of \
the library sees them: connects to the subsystem at -a/-s and at every --path (or, with \
--discover, at every address the discovery controller at -a lists for -n), reads each \
path's ANA log page, and prints each path: its address, controller ID and state, the ANA \
state of each group, and which path I/O to namespace --namespace-id would take now \
(optimized, else non-optimized; never inaccessible, persistent loss or change). Then \
disconnects.",
        override_usage = "nvmeof list-paths -a ADDRESS -n NQN [-s PORT] [--path ADDRESS[:PORT]]... [OPTIONS]\n       nvmeof list-paths --discover -a DISCOVERY-ADDRESS -n NQN [-s PORT] [OPTIONS]"
    )]
    ListPaths {
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
        /// Another path to the subsystem (repeat for more): ADDRESS or ADDRESS:PORT, an IPv6
        /// address in brackets (default port: -s, else 4420).
        #[arg(long = "path", value_name = "ADDRESS[:PORT]")]
        paths: Vec<String>,
        /// Take the paths from the discovery log at -a (port -s, else 8009): every entry of
        /// subsystem -n.
        #[arg(long = "discover")]
        discover: bool,
        /// The namespace whose ANA group decides the current path.
        #[arg(long = "namespace-id", default_value_t = 1, value_name = "NSID")]
        namespace_id: u32,
    },
    /// List the subsystems nvmeof-initd is attached to, with their attachments (nvme-cli's
    /// list-subsys).
    ListSubsys,
    /// Print Identify Controller (fields in the specification's order).
    IdCtrl {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        /// Decode key fields (version, MDTS, ONCS, VWC, SGLS, ...) for people.
        #[arg(short = 'H', long = "human-readable")]
        human: bool,
    },
    /// Print Identify Namespace (fields in the specification's order).
    IdNs {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        /// Namespace (default: the attachment's, or 1).
        #[arg(long = "namespace-id", value_name = "NSID")]
        namespace_id: Option<u32>,
        /// Decode key fields (sizes, features, the LBA format in use) for people.
        #[arg(short = 'H', long = "human-readable")]
        human: bool,
    },
    /// Read blocks into a file or stdout.
    #[command(
        long_about = "Reads --blocks blocks (or --data-size bytes) starting at --start-block \
and writes them to --data (a file, or - / nothing for stdout). Progress is shown on a \
terminal.

nvme-cli's -s (first block) and -c/--block-count (a 0-based count) are refused with what to \
type instead: here -s would be the port and -c the reconnect delay, as they are in every \
other command. With -a, the port is --trsvcid.",
        override_usage = "nvmeof read NAME --blocks N [--start-block LBA] [OPTIONS]\n       \
nvmeof read -a ADDRESS -n NQN --blocks N [--start-block LBA] [OPTIONS]",
        mut_arg("trsvcid", |a| a.short(None)),
        mut_arg("reconnect_delay", |a| a.short(None))
    )]
    Read {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
        #[command(flatten)]
        range: RangeArgs,
    },
    /// Write blocks from a file or stdin.
    #[command(
        long_about = "Writes blocks starting at --start-block from --data (a file, or - / \
nothing for stdin). Without --blocks or --data-size the whole file is written (its size \
must be a multiple of the block size). Progress is shown on a terminal.

nvme-cli's -s (first block) and -c/--block-count (a 0-based count) are refused with what to \
type instead: here -s would be the port and -c the reconnect delay, as they are in every \
other command. With -a, the port is --trsvcid.",
        override_usage = "nvmeof write NAME [--start-block LBA] [--data FILE] [OPTIONS]\n       \
nvmeof write -a ADDRESS -n NQN [--start-block LBA] [--data FILE] [OPTIONS]",
        mut_arg("trsvcid", |a| a.short(None)),
        mut_arg("reconnect_delay", |a| a.short(None))
    )]
    Write {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
        #[command(flatten)]
        range: RangeArgs,
        #[command(flatten)]
        durability: Durability,
    },
    /// Register, unregister or replace a reservation key (nvme-cli's resv-register).
    #[command(
        long_about = "nvme-cli's resv-register: --rrega 0 registers --nrkey, 1 unregisters \
(--crkey must match unless --iekey), 2 replaces --crkey with --nrkey. --cptpl 2 turns Persist \
Through Power Loss off, 3 on (the target keeps the reservations across restarts). Keys are \
decimal or 0x-prefixed hex. Registrations belong to the host identifier (--hostid), shared by \
every controller of the host."
    )]
    ResvRegister {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        resv: ResvArgs,
        /// New reservation key.
        #[arg(long, default_value = "0", value_parser = parse_key)]
        nrkey: u64,
        /// Action: 0 register, 1 unregister, 2 replace.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
        rrega: u8,
        /// Change Persist Through Power Loss: 0 no change, 2 off, 3 on.
        #[arg(long, default_value_t = 0, value_parser = parse_cptpl)]
        cptpl: u8,
    },
    /// Acquire or preempt a reservation (nvme-cli's resv-acquire).
    #[command(
        long_about = "nvme-cli's resv-acquire: --racqa 0 acquires a reservation of type \
--rtype, 1 preempts the registrants whose key is --prkey (taking the reservation when they \
held it), 2 preempts and aborts. Types: 1 Write Exclusive, 2 Exclusive Access, 3/4 the same \
for Registrants Only, 5/6 for All Registrants."
    )]
    ResvAcquire {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        resv: ResvArgs,
        /// Key of the registrants to preempt.
        #[arg(long, default_value = "0", value_parser = parse_key)]
        prkey: u64,
        /// Reservation type (1..6).
        #[arg(long, value_parser = clap::value_parser!(u8).range(1..=6))]
        rtype: u8,
        /// Action: 0 acquire, 1 preempt, 2 preempt and abort.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
        racqa: u8,
    },
    /// Release or clear a reservation (nvme-cli's resv-release).
    #[command(
        long_about = "nvme-cli's resv-release: --rrela 0 releases the reservation of type \
--rtype this host holds, 1 clears every registration and the reservation."
    )]
    ResvRelease {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        resv: ResvArgs,
        /// Type of the reservation held (Release).
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=6))]
        rtype: u8,
        /// Action: 0 release, 1 clear.
        #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
        rrela: u8,
    },
    /// Print the registrants and the reservation (nvme-cli's resv-report).
    #[command(
        long_about = "nvme-cli's resv-report: the generation, the reservation type, Persist \
Through Power Loss and each registrant (key, host identifier, whether it holds the \
reservation). NVMe over Fabrics controllers answer only with the extended structure \
(--eds); without it they refuse with Host Identifier Inconsistent Format."
    )]
    ResvReport {
        /// An attachment name (instead of -a/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        /// Namespace (default: the attachment's, or 1).
        #[arg(long = "namespace-id", value_name = "NSID")]
        namespace_id: Option<u32>,
        /// Ask for the extended data structure (128-bit host identifiers).
        #[arg(long)]
        eds: bool,
    },
}

/// Arguments every reservation command but the report takes.
#[derive(Args, Clone, Copy)]
struct ResvArgs {
    /// Namespace (default: the attachment's, or 1).
    #[arg(long = "namespace-id", value_name = "NSID")]
    namespace_id: Option<u32>,
    /// Current reservation key.
    #[arg(long, default_value = "0", value_parser = parse_key)]
    crkey: u64,
    /// Ignore the existing key.
    #[arg(long)]
    iekey: bool,
}

/// A reservation key: decimal or 0x-prefixed hexadecimal.
fn parse_key(s: &str) -> std::result::Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("{s:?} is not a 64-bit key (decimal or 0x hex)"))
}

fn parse_cptpl(s: &str) -> std::result::Result<u8, String> {
    match s.parse() {
        Ok(v @ (0 | 2 | 3)) => Ok(v),
        _ => Err(format!("{s:?}: 0 (no change), 2 (off) or 3 (on)")),
    }
}

/// How `write` makes its data durable on targets with a volatile write cache.
#[derive(Args, Clone, Copy, Default)]
struct Durability {
    /// Send a Flush after the write so the data is durable.
    #[arg(long)]
    flush: bool,
    /// Write with Force Unit Access: each write command completes only once its data is
    /// durable (nvme-cli's flag).
    #[arg(short = 'f', long = "force-unit-access")]
    force_unit_access: bool,
}

/// Where the target is (nvme-cli's flags).
#[derive(Args, Clone, Default)]
struct Fabric {
    /// Transport type: `tcp` (the default) or `rdma` (NVMe/RDMA needs rdma-core and an RDMA
    /// device).
    #[arg(short = 't', long = "transport", value_name = "TRTYPE")]
    transport: Option<String>,
    /// Target address (IP address or host name).
    #[arg(short = 'a', long = "traddr", value_name = "ADDRESS")]
    traddr: Option<String>,
    /// Target port (transport service ID).
    #[arg(short = 's', long = "trsvcid", value_name = "PORT")]
    trsvcid: Option<u16>,
    /// Subsystem NQN.
    #[arg(short = 'n', long = "nqn", value_name = "NQN")]
    nqn: Option<String>,
    /// Host NQN (default: /etc/nvme/hostnqn, or one generated and stored once).
    #[arg(short = 'q', long = "hostnqn", value_name = "NQN")]
    hostnqn: Option<String>,
    /// Host identifier, a UUID (default: /etc/nvme/hostid, or stored with the host NQN).
    #[arg(short = 'I', long = "hostid", value_name = "UUID")]
    hostid: Option<String>,
    /// Use NVMe/TCP header digests.
    #[arg(short = 'g', long = "hdr-digest")]
    hdr_digest: bool,
    /// Use NVMe/TCP data digests.
    #[arg(short = 'G', long = "data-digest")]
    data_digest: bool,
    /// Keep SQ flow control on (by default each queue asks the controller to disable it,
    /// which spares a response PDU per read over NVMe/TCP).
    #[arg(long = "sq-flow-control")]
    sq_flow_control: bool,
    /// Seconds to wait for the connection and for each admin command.
    #[arg(long = "timeout", default_value_t = 10, value_name = "SECS")]
    timeout: u64,
    /// DH-HMAC-CHAP host secret, `DHHC-1:XX:<base64>:` as `nvme gen-dhchap-key` prints it:
    /// used on every queue whose controller requires authentication.
    #[arg(short = 'S', long = "dhchap-secret", value_name = "SECRET")]
    dhchap_secret: Option<String>,
    /// DH-HMAC-CHAP controller secret: the controller must prove it holds it too
    /// (bidirectional authentication). Needs --dhchap-secret.
    #[arg(short = 'C', long = "dhchap-ctrl-secret", value_name = "SECRET")]
    dhchap_ctrl_secret: Option<String>,
    /// NVMe/TCP over TLS 1.3 with a pre-shared key (the key comes from --tls-key).
    #[arg(long = "tls")]
    tls: bool,
    /// The configured TLS PSK, `NVMeTLSkey-1:01:<base64>:` as `nvme gen-tls-key` prints it:
    /// the TLS PSK and its identity (`NVMe0R01 <hostnqn> <subnqn>`) are derived from it.
    /// Implies --tls.
    #[arg(long = "tls-key", value_name = "KEY")]
    tls_key: Option<String>,
}

#[derive(Args, Clone, Default)]
struct QueueArgs {
    /// Number of I/O queues (default: 1 for one-off commands; one per core for programs
    /// opening an attachment).
    #[arg(short = 'i', long = "nr-io-queues", value_name = "N")]
    nr_io_queues: Option<u16>,
    /// Entries per I/O queue (default 128, capped by the controller).
    #[arg(short = 'Q', long = "queue-size", value_name = "N")]
    queue_size: Option<u16>,
    /// Keep alive timeout in seconds (default 5).
    #[arg(short = 'k', long = "keep-alive-tmo", value_name = "SECS")]
    keep_alive_tmo: Option<u32>,
    /// After the connection to the target is lost, keep reconnecting this many seconds before
    /// failing (-1: forever; default 10). Each reconnect is reported on stderr.
    #[arg(
        short = 'l',
        long = "ctrl-loss-tmo",
        value_name = "SECS",
        allow_negative_numbers = true
    )]
    ctrl_loss_tmo: Option<i64>,
    /// Seconds between reconnect attempts (default: 0.25 s, doubling up to 10 s).
    #[arg(short = 'c', long = "reconnect-delay", value_name = "SECS")]
    reconnect_delay: Option<u32>,
}

#[derive(Args, Clone)]
struct RangeArgs {
    /// Namespace (default: the attachment's, or 1).
    #[arg(long = "namespace-id", value_name = "NSID")]
    namespace_id: Option<u32>,
    /// First block (nvme-cli's --start-block).
    #[arg(long = "start-block", default_value_t = 0, value_name = "LBA")]
    start_block: u64,
    /// Number of blocks, counted from 1 (read: this or --data-size is needed; write: default
    /// the size of --data).
    #[arg(long = "blocks", value_name = "N")]
    blocks: Option<u64>,
    /// Bytes to transfer (nvme-cli's --data-size): a multiple of the block size, and
    /// --blocks times it when both are given.
    #[arg(short = 'z', long = "data-size", value_name = "BYTES")]
    data_size: Option<u64>,
    /// File to read from or write to; `-` or absent: stdin/stdout.
    #[arg(short = 'd', long = "data", value_name = "FILE")]
    data: Option<PathBuf>,
    /// nvme-cli's -s (first block): refused, it is the port in every other command.
    #[arg(
        short = 's',
        hide = true,
        value_name = "LBA",
        allow_hyphen_values = true
    )]
    nvme_cli_start: Option<String>,
    /// nvme-cli's -c/--block-count (0-based): refused, see --blocks.
    #[arg(
        short = 'c',
        long = "block-count",
        hide = true,
        value_name = "N",
        allow_hyphen_values = true
    )]
    nvme_cli_count: Option<String>,
}

impl RangeArgs {
    /// Refuses nvme-cli's flags whose meaning differs here, saying what to type instead.
    fn refuse_nvme_cli_flags(&self) -> Result<()> {
        if let Some(v) = &self.nvme_cli_start {
            usage!(
                "-s is not taken by read/write: give the first block as --start-block {v} \
                 (nvme-cli's -s) and, with -a, the port as --trsvcid PORT"
            );
        }
        if let Some(v) = &self.nvme_cli_count {
            match v.parse::<u64>() {
                Ok(n) => usage!(
                    "-c/--block-count is not taken: nvme-cli counts it from 0 ({n} means {}); \
                     give the number of blocks as --blocks {} (or the bytes as --data-size)",
                    count_of(n.saturating_add(1), "block"),
                    n.saturating_add(1)
                ),
                Err(_) => usage!(
                    "-c/--block-count is not taken: give the number of blocks as --blocks N \
                     (counted from 1) or the bytes as --data-size BYTES"
                ),
            }
        }
        if self.blocks == Some(0) || self.data_size == Some(0) {
            usage!("nothing to transfer: --blocks and --data-size must be at least 1");
        }
        Ok(())
    }

    /// The number of blocks that --blocks and --data-size give for blocks of `bs` bytes, if
    /// any.
    fn count(&self, bs: u64) -> Result<Option<u64>> {
        match (self.blocks, self.data_size) {
            (Some(b), Some(z)) if b.checked_mul(bs) != Some(z) => usage!(
                "--data-size {z} is not --blocks {b} blocks of {bs} bytes ({} bytes); give one \
                 of them",
                b.saturating_mul(bs)
            ),
            (b @ Some(_), _) => Ok(b),
            (None, Some(z)) if z % bs != 0 => usage!(
                "--data-size {z} is not a multiple of the block size {bs} (give --blocks N, \
                 or a size of whole blocks)"
            ),
            (None, Some(z)) => Ok(Some(z / bs)),
            (None, None) => Ok(None),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if cli.verbose {
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_env("NVMEOF_LOG")
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .try_init();
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nvmeof: error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvmeof: error: {}", one_line(&e));
            ExitCode::from(exit_status(&e))
        }
    }
}

/// The error and its causes in one line, each said once: a cause whose text an outer message
/// already contains is left out, and an outer message that a cause repeats in full gives way
/// to that cause.
fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let msg = cause.to_string().replace('\n', " ");
        if parts.iter().any(|p| p.contains(&msg)) {
            continue;
        }
        match parts.last_mut() {
            Some(last) if msg.contains(last.as_str()) => *last = msg,
            _ => parts.push(msg),
        }
    }
    parts.join(": ")
}

/// The exit status for an error (see LONG_ABOUT).
fn exit_status(e: &anyhow::Error) -> u8 {
    use nvmeof_initiator::ErrorClass as C;
    for cause in e.chain() {
        if cause.is::<Usage>() {
            return 2;
        }
        if let Some(ie) = cause.downcast_ref::<nvmeof_initiator::Error>() {
            return match ie.class() {
                C::Usage => 2,
                C::Target => 3,
                C::Status => 4,
                C::Daemon => 5,
                C::Other => 1,
            };
        }
    }
    1
}
struct Ctx {
    output: Output,
    /// The nvmeof-initd sockets to try, in order.
    sockets: Vec<PathBuf>,
    state_dir: PathBuf,
}

impl Ctx {
    async fn daemon(&self) -> Result<DaemonClient> {
        Ok(DaemonClient::connect_first(&self.sockets).await?)
    }
}

async fn run(cli: Cli) -> Result<()> {
    let ctx = Ctx {
        output: cli.output,
        sockets: cli
            .socket
            .map_or_else(daemon::client_socket_paths, |s| vec![s]),
        state_dir: cli.state_dir.unwrap_or_else(default_state_dir),
    };
    match cli.cmd {
        Cmd::Discover {
            fabric,
            referrals,
            max_depth,
            mdns: true,
            mdns_wait,
        } => cmd_discover_mdns(&ctx, &fabric, referrals.then_some(max_depth), mdns_wait).await,
        Cmd::Discover {
            fabric,
            referrals,
            max_depth,
            ..
        } => cmd_discover(&ctx, &fabric, referrals.then_some(max_depth)).await,
        Cmd::Probe { fabric, queues } => cmd_probe(&ctx, &fabric, &queues).await,
        Cmd::Connect {
            fabric,
            queues,
            namespace_id,
            name,
            paths,
        } => {
            cmd_connect(
                &ctx,
                &fabric,
                &queues,
                namespace_id,
                name.as_deref(),
                &paths,
            )
            .await
        }
        Cmd::ConnectAll { fabric, queues } => cmd_connect_all(&ctx, &fabric, &queues).await,
        Cmd::Disconnect { name, nqn, device } => cmd_disconnect(&ctx, name, nqn, device).await,
        Cmd::DisconnectAll => cmd_disconnect_all(&ctx).await,
        Cmd::ListSubsys => cmd_list_subsys(&ctx).await,
        Cmd::ListPaths {
            fabric,
            queues,
            paths,
            discover,
            namespace_id,
        } => cmd_list_paths(&ctx, &fabric, &queues, &paths, discover, namespace_id).await,
        Cmd::Attach {
            name,
            fabric,
            queues,
            namespace_id,
            paths,
        } => cmd_attach(&ctx, &name, &fabric, &queues, namespace_id, &paths).await,
        Cmd::Detach { name } => {
            let mut c = ctx.daemon().await?;
            c.detach(&name).await?;
            match ctx.output {
                Output::Json => print_json(&json!({ "detached": name })),
                Output::Normal => println!("detached {name}"),
            }
            Ok(())
        }
        Cmd::List => cmd_list(&ctx).await,
        Cmd::IdCtrl {
            name,
            fabric,
            human,
        } => cmd_id_ctrl(&ctx, name.as_deref(), &fabric, human).await,
        Cmd::IdNs {
            name,
            fabric,
            namespace_id,
            human,
        } => cmd_id_ns(&ctx, name.as_deref(), &fabric, namespace_id, human).await,
        Cmd::Read {
            name,
            fabric,
            queues,
            range,
        } => cmd_read(&ctx, name.as_deref(), &fabric, &queues, &range).await,
        Cmd::Write {
            name,
            fabric,
            queues,
            range,
            durability,
        } => cmd_write(&ctx, name.as_deref(), &fabric, &queues, &range, durability).await,
        Cmd::ResvRegister {
            name,
            fabric,
            resv,
            nrkey,
            rrega,
            cptpl,
        } => {
            let action = match rrega {
                0 => ResvRegister::Register,
                1 => ResvRegister::Unregister,
                _ => ResvRegister::Replace,
            };
            with_namespace(
                &ctx,
                name.as_deref(),
                &fabric,
                resv.namespace_id,
                |ns| async move {
                    ns.resv_register(action, resv.crkey, nrkey, resv.iekey, cptpl)
                        .await
                        .map_err(Into::into)
                },
            )
            .await
        }
        Cmd::ResvAcquire {
            name,
            fabric,
            resv,
            prkey,
            rtype,
            racqa,
        } => {
            let action = match racqa {
                0 => ResvAcquire::Acquire,
                1 => ResvAcquire::Preempt,
                _ => ResvAcquire::PreemptAndAbort,
            };
            with_namespace(
                &ctx,
                name.as_deref(),
                &fabric,
                resv.namespace_id,
                |ns| async move {
                    ns.resv_acquire(action, rtype, resv.crkey, prkey, resv.iekey)
                        .await
                        .map_err(Into::into)
                },
            )
            .await
        }
        Cmd::ResvRelease {
            name,
            fabric,
            resv,
            rtype,
            rrela,
        } => {
            let action = if rrela == 0 {
                ResvRelease::Release
            } else {
                ResvRelease::Clear
            };
            with_namespace(
                &ctx,
                name.as_deref(),
                &fabric,
                resv.namespace_id,
                |ns| async move {
                    ns.resv_release(action, rtype, resv.crkey, resv.iekey)
                        .await
                        .map_err(Into::into)
                },
            )
            .await
        }
        Cmd::ResvReport {
            name,
            fabric,
            namespace_id,
            eds,
        } => {
            let output = ctx.output;
            with_namespace(
                &ctx,
                name.as_deref(),
                &fabric,
                namespace_id,
                |ns| async move {
                    let r = ns.resv_report(eds).await?;
                    print_resv_report(output, &r);
                    Ok(())
                },
            )
            .await
        }
    }
}

/// Opens namespace `nsid` over one I/O queue, runs `f` on it and disconnects.
async fn with_namespace<F, Fut>(
    ctx: &Ctx,
    name: Option<&str>,
    f: &Fabric,
    nsid: Option<u32>,
    run: F,
) -> Result<()>
where
    F: FnOnce(Namespace) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let q = QueueArgs::default();
    let ns = open_namespace(ctx, name, f, &q, nsid).await?;
    let ctrl = ns.controller().clone();
    let res = run(ns).await;
    let _ = ctrl.disconnect().await;
    res
}

fn resv_type_name(t: u8) -> &'static str {
    match t {
        0 => "none",
        1 => "Write Exclusive",
        2 => "Exclusive Access",
        3 => "Write Exclusive - Registrants Only",
        4 => "Exclusive Access - Registrants Only",
        5 => "Write Exclusive - All Registrants",
        6 => "Exclusive Access - All Registrants",
        _ => "reserved",
    }
}

fn print_resv_report(output: Output, r: &ReservationStatus) {
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    if output == Output::Json {
        let regs: Vec<Value> = r
            .registrants
            .iter()
            .map(|g| {
                json!({
                    "cntlid": g.cntlid,
                    "rcsts": u8::from(g.holds),
                    "hostid": hex(&g.hostid),
                    "rkey": g.rkey,
                })
            })
            .collect();
        print_json(&json!({
            "gen": r.generation,
            "rtype": r.rtype,
            "regctl": r.registrants.len(),
            "ptpls": u8::from(r.ptpl),
            "regctlext": regs,
        }));
        return;
    }
    println!("NVME Reservation status:\n");
    println!("gen       : {}", r.generation);
    println!("rtype     : {} ({})", r.rtype, resv_type_name(r.rtype));
    println!("regctl    : {}", r.registrants.len());
    println!("ptpls     : {}", u8::from(r.ptpl));
    for (i, g) in r.registrants.iter().enumerate() {
        println!("\nregctlext[{i}] :");
        println!("  cntlid     : {:x}", g.cntlid);
        println!("  rcsts      : {:x}", u8::from(g.holds));
        println!("  hostid     : {}", hex(&g.hostid));
        println!("  rkey       : {:x}", g.rkey);
    }
}

fn print_json(v: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

fn identity(ctx: &Ctx, f: &Fabric) -> Result<HostIdentity> {
    let parse = |s: &str| {
        parse_hostid(s)
            .ok_or_else(|| anyhow::Error::new(Usage(format!("--hostid {s:?} is not a UUID"))))
    };
    let (hostnqn, hostid) = match (&f.hostnqn, &f.hostid) {
        (Some(n), Some(i)) => (n.clone(), parse(i)?),
        (n, i) => {
            let stored = HostIdentity::load_or_create(&ctx.state_dir)
                .context("cannot determine the host identity (use --hostnqn and --hostid)")?;
            let id = match i {
                Some(i) => parse(i)?,
                None => stored.hostid,
            };
            (n.clone().unwrap_or(stored.hostnqn), id)
        }
    };
    Ok(HostIdentity::new(&hostnqn, hostid)?)
}

fn check_transport(f: &Fabric) -> Result<Transport> {
    let t: Transport = f.transport.as_deref().unwrap_or("tcp").parse()?;
    if t == Transport::Rdma && (f.hdr_digest || f.data_digest) {
        usage!("digests (-g, -G) are an NVMe/TCP feature; NVMe/RDMA has none");
    }
    Ok(t)
}

/// Options for reading a discovery log at `addr` with the fabric flags (identity, digests,
/// `--timeout` for connecting and for admin commands).
fn discovery_options(ctx: &Ctx, f: &Fabric, addr: TargetAddr) -> Result<DiscoveryOptions> {
    let mut opts = DiscoveryOptions::new(addr, identity(ctx, f)?);
    opts.header_digest = f.hdr_digest;
    opts.data_digest = f.data_digest;
    let t = Duration::from_secs(f.timeout.max(1));
    opts.timeouts.connect = t;
    opts.timeouts.admin = t;
    Ok(opts)
}

fn target_addr(f: &Fabric, default_port: u16) -> Result<TargetAddr> {
    let t = check_transport(f)?;
    let Some(a) = f.traddr.as_deref() else {
        usage!("the target address is missing (-a ADDRESS)");
    };
    Ok(TargetAddr::new(a, f.trsvcid.unwrap_or(default_port)).with_transport(t))
}

/// The DH-HMAC-CHAP secrets of the flags, checked.
fn dhchap(f: &Fabric) -> Result<Option<DhchapSecrets>> {
    match (&f.dhchap_secret, &f.dhchap_ctrl_secret) {
        (None, None) => Ok(None),
        (None, Some(_)) => usage!("--dhchap-ctrl-secret needs --dhchap-secret"),
        (Some(h), c) => Ok(Some(DhchapSecrets::parse(h, c.as_deref())?)),
    }
}

/// The TLS settings of the flags, checked.
fn tls(f: &Fabric) -> Result<Option<TlsOptions>> {
    match (&f.tls_key, f.tls) {
        (None, false) => Ok(None),
        (None, true) => usage!("--tls needs the PSK: give --tls-key KEY (from nvme gen-tls-key)"),
        (Some(k), _) => Ok(Some(TlsOptions::parse(k)?)),
    }
}

fn direct_options(ctx: &Ctx, f: &Fabric, q: &QueueArgs) -> Result<ConnectOptions> {
    let addr = target_addr(f, DEFAULT_PORT)?;
    let Some(nqn) = f.nqn.as_deref() else {
        usage!("the subsystem NQN is missing (-n NQN)");
    };
    let mut o = ConnectOptions::new(addr, nqn, identity(ctx, f)?);
    o.header_digest = f.hdr_digest;
    o.data_digest = f.data_digest;
    o.disable_sq_flow_control = !f.sq_flow_control;
    o.dhchap = dhchap(f)?;
    o.tls = tls(f)?;
    apply_queue_args(&mut o, q, f.timeout);
    Ok(o)
}

fn apply_queue_args(o: &mut ConnectOptions, q: &QueueArgs, timeout: u64) {
    o.io_queues = Some(q.nr_io_queues.unwrap_or(1));
    if let Some(n) = q.queue_size {
        o.queue_depth = n;
    }
    if let Some(k) = q.keep_alive_tmo {
        o.kato = Duration::from_secs(u64::from(k));
    }
    let t = Duration::from_secs(timeout.max(1));
    o.timeouts.connect = t;
    o.timeouts.admin = t;
    // A one-off command does not wait long for a target that went away, unless told to.
    let loss = match q.ctrl_loss_tmo {
        None => Some(Duration::from_secs(10)),
        Some(s) if s < 0 => None,
        Some(s) => Some(Duration::from_secs(s.unsigned_abs())),
    };
    o.reconnect = ReconnectPolicy {
        ctrl_loss_timeout: loss,
        ..ReconnectPolicy::default()
    };
    if let Some(d) = q.reconnect_delay {
        let d = Duration::from_secs(u64::from(d));
        o.reconnect.initial_delay = d;
        o.reconnect.max_delay = d;
    }
    // Each I/O waits through the reconnect window (a year stands for forever).
    o.timeouts.io = match loss {
        Some(l) => o.timeouts.io.max(t).max(l + t),
        None => Duration::from_secs(365 * 86_400),
    };
}

/// Reports on stderr, one line each, when the connection to the target is lost and when it is
/// back. Ends when the controller fails or closes.
fn report_reconnects(ctrl: &Controller, loss: Option<Duration>) {
    use nvmeof_initiator::ControllerState as S;
    let ctrl = ctrl.clone();
    let addr = ctrl.info().addr;
    let forever = Duration::from_secs(365 * 86_400);
    let line = |msg: String| {
        // Clears a progress line first.
        let clear = if std::io::stderr().is_terminal() {
            "\r\x1b[K"
        } else {
            ""
        };
        eprintln!("{clear}nvmeof: {msg}");
    };
    tokio::spawn(async move {
        loop {
            let lost = ctrl
                .wait_for_state(forever, |s| !matches!(s, S::Connected))
                .await;
            let Ok(S::Reconnecting { last_error, .. }) = lost else {
                return;
            };
            let until = loss.map_or_else(
                || "until it is back (--ctrl-loss-tmo -1)".to_string(),
                |l| format!("for up to {} s (--ctrl-loss-tmo)", l.as_secs()),
            );
            line(format!(
                "connection to {addr} lost ({last_error}); reconnecting {until}"
            ));
            match ctrl
                .wait_for_state(forever, |s| !matches!(s, S::Reconnecting { .. }))
                .await
            {
                Ok(S::Connected) => line(format!("reconnected to {addr}")),
                _ => return,
            }
        }
    });
}

/// Connection settings from an attachment name or from the fabric flags; returns them with
/// the attachment's namespace (if any).
async fn resolve(
    ctx: &Ctx,
    name: Option<&str>,
    f: &Fabric,
    q: &QueueArgs,
) -> Result<(ConnectOptions, Option<u32>)> {
    match name {
        Some(name) => {
            let given = [
                (f.traddr.is_some(), "-a"),
                (f.trsvcid.is_some(), "-s/--trsvcid"),
                (f.nqn.is_some(), "-n"),
                (f.transport.is_some(), "-t"),
                (f.hostnqn.is_some(), "--hostnqn"),
                (f.hostid.is_some(), "--hostid"),
            ];
            let given: Vec<&str> = given.iter().filter(|g| g.0).map(|g| g.1).collect();
            if !given.is_empty() {
                usage!(
                    "attachment {name} has its own target and host identity: give either the \
                     name or {}, not both",
                    given.join(" ")
                );
            }
            let (mut o, nsid) = ctx.daemon().await?.attached_options(name).await?;
            if f.hdr_digest {
                o.header_digest = true;
            }
            if f.data_digest {
                o.data_digest = true;
            }
            if f.sq_flow_control {
                o.disable_sq_flow_control = false;
            }
            if let Some(d) = dhchap(f)? {
                o.dhchap = Some(d);
            }
            if let Some(t) = tls(f)? {
                o.tls = Some(t);
            }
            apply_queue_args(&mut o, q, f.timeout);
            Ok((o, Some(nsid)))
        }
        None => Ok((direct_options(ctx, f, q)?, None)),
    }
}

async fn cmd_discover(ctx: &Ctx, f: &Fabric, referrals: Option<u32>) -> Result<()> {
    let addr = target_addr(f, DEFAULT_DISCOVERY_PORT)?;
    let opts = discovery_options(ctx, f, addr.clone())?;
    let Some(max_depth) = referrals else {
        let log = discover(&opts)
            .await
            .with_context(|| format!("discovery at {addr} failed"))?;
        match ctx.output {
            Output::Json => print_json(&log_json(&log)),
            Output::Normal => print_log(&log),
        }
        return Ok(());
    };
    let logs = discover_referrals(&opts, max_depth)
        .await
        .with_context(|| format!("discovery at {addr} failed"))?;
    print_referred(ctx, &logs)
}

/// `discover --mdns`: browses for `_nvme-disc._tcp`, then reads each discovery controller found
/// (and, with `referrals`, those they refer to).
async fn cmd_discover_mdns(ctx: &Ctx, f: &Fabric, referrals: Option<u32>, wait: u64) -> Result<()> {
    if f.traddr.is_some() {
        usage!("--mdns finds the discovery controllers itself: -a is not taken");
    }
    let found = nvmeof_mdns::browse(Duration::from_secs(wait.clamp(1, 60)))
        .await
        .context("mDNS browse failed")?;
    let mut starts = Vec::new();
    for s in &found {
        let transport = match s.transport() {
            "tcp" => Transport::Tcp,
            "rdma" | "roce" | "iwarp" => Transport::Rdma,
            other => {
                eprintln!(
                    "nvmeof: {} (port {}): transport {other:?} not used by discover --mdns",
                    s.instance, s.port
                );
                continue;
            }
        };
        for a in &s.addrs {
            starts.push(TargetAddr::new(a.to_string(), s.port).with_transport(transport));
        }
    }
    if starts.is_empty() {
        anyhow::bail!(
            "no discovery controller answered over mDNS (_nvme-disc._tcp) within {wait} s"
        );
    }
    let addr = TargetAddr::new("0.0.0.0", DEFAULT_DISCOVERY_PORT);
    let opts = discovery_options(ctx, f, addr)?;
    let logs = nvmeof_initiator::discover_all(&opts, starts, referrals.unwrap_or(0)).await;
    print_referred(ctx, &logs)
}

/// Prints the logs read while following referrals; fails (after printing every log) when a
/// referred discovery controller could not be read.
fn print_referred(ctx: &Ctx, logs: &[nvmeof_initiator::ReferredLog]) -> Result<()> {
    let mut failed = None;
    let mut json = Vec::new();
    for r in logs {
        let a = &r.addr;
        let mut v = json!({
            "trtype": a.transport.to_string(),
            "traddr": a.host,
            "trsvcid": a.port.to_string(),
            "depth": r.depth,
        });
        match &r.log {
            Ok(log) => match ctx.output {
                Output::Json => {
                    let l = log_json(log);
                    v["genctr"] = l["genctr"].clone();
                    v["records"] = l["records"].clone();
                }
                Output::Normal => {
                    println!("Discovery controller {a} (referral level {})", r.depth);
                    print_log(log);
                }
            },
            Err(e) => {
                eprintln!(
                    "nvmeof: discovery at {a} (referral level {}) failed: {e}",
                    r.depth
                );
                v["error"] = json!(e.to_string());
                failed = Some(anyhow::anyhow!("discovery at {a} failed: {e}"));
            }
        }
        json.push(v);
    }
    if matches!(ctx.output, Output::Json) {
        print_json(&json!({ "controllers": json }));
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn log_json(log: &DiscoveryLog) -> Value {
    let records: Vec<Value> = log
        .entries
        .iter()
        .map(|e| {
            let mut r = json!({
                "trtype": e.trtype_name(),
                "adrfam": e.adrfam_name(),
                "subtype": e.subtype_name(),
                "treq": e.treq_name(),
                "portid": e.portid,
                "trsvcid": e.trsvcid,
                "subnqn": e.subnqn,
                "traddr": e.traddr,
                "cntlid": e.cntlid,
                "asqsz": e.asqsz,
                "eflags": e.eflags,
            });
            if let Some(t) = &e.rdma {
                r["tsas"] = json!({
                    "prtype": t.prtype_name(),
                    "qptype": t.qptype_name(),
                    "cms": t.cms_name(),
                    "pkey": format!("{:#06x}", t.pkey),
                });
            }
            r
        })
        .collect();
    json!({ "genctr": log.genctr, "records": records })
}

fn print_log(log: &DiscoveryLog) {
    println!(
        "Discovery Log Number of Records {}, Generation counter {}",
        log.entries.len(),
        log.genctr
    );
    for (i, e) in log.entries.iter().enumerate() {
        println!("=====Discovery Log Entry {i}======");
        println!("trtype:  {}", e.trtype_name());
        println!("adrfam:  {}", e.adrfam_name());
        println!("subtype: {}", e.subtype_name());
        println!("treq:    {}", e.treq_name());
        println!("portid:  {}", e.portid);
        println!("trsvcid: {}", e.trsvcid);
        println!("subnqn:  {}", e.subnqn);
        println!("traddr:  {}", e.traddr);
        if let Some(t) = &e.rdma {
            println!("rdma_prtype: {}", t.prtype_name());
            println!("rdma_qptype: {}", t.qptype_name());
            println!("rdma_cms:    {}", t.cms_name());
            println!("rdma_pkey: {:#06x}", t.pkey);
        }
    }
}

fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Connects a controller; an error names the address, and the host NQN and the subsystem when
/// the target refused them.
async fn connect_direct(opts: ConnectOptions) -> Result<Controller> {
    let addr = opts.addr.clone();
    let host = opts.host.hostnqn.clone();
    let subnqn = opts.subnqn.clone();
    Controller::connect(opts).await.map_err(|e| {
        let hint = nvmeof_initiator::connect_hint(&e, &host, &subnqn);
        let e = anyhow::Error::new(e);
        let e = match hint {
            Some(h) => e.context(h),
            None => e,
        };
        e.context(format!("cannot connect to {addr}"))
    })
}

/// `ADDRESS`, `ADDRESS:PORT` or an IPv6 address in brackets with its port, as a path of
/// transport `t`.
fn parse_path(s: &str, default_port: u16, t: Transport) -> Result<TargetAddr> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let Some((h, p)) = rest.split_once(']') else {
            usage!("path {s:?}: an IPv6 address in brackets needs its closing ']'");
        };
        match p.strip_prefix(':') {
            Some(p) => (h, Some(p)),
            None if p.is_empty() => (h, None),
            None => usage!("path {s:?}: expected [IPv6]:PORT"),
        }
    } else {
        match s.split_once(':') {
            Some((h, p)) if !p.contains(':') => (h, Some(p)),
            _ => (s, None),
        }
    };
    if host.is_empty() {
        usage!("path {s:?} has no address");
    }
    let port = match port {
        None => default_port,
        Some(p) => match p.parse::<u16>() {
            Ok(p) if p != 0 => p,
            _ => usage!("path {s:?}: {p:?} is not a port (1-65535)"),
        },
    };
    Ok(TargetAddr::new(host, port).with_transport(t))
}

/// The paths of `list-paths`: -a/-s and every --path, or those the discovery log at -a
/// lists for -n.
async fn multipath_addrs(
    ctx: &Ctx,
    f: &Fabric,
    extra: &[String],
    from_discovery: bool,
) -> Result<Vec<TargetAddr>> {
    let t = check_transport(f)?;
    let Some(nqn) = f.nqn.as_deref() else {
        usage!("the subsystem NQN is missing (-n NQN)");
    };
    if !from_discovery {
        let mut addrs = vec![target_addr(f, DEFAULT_PORT)?];
        for p in extra {
            addrs.push(parse_path(p, f.trsvcid.unwrap_or(DEFAULT_PORT), t)?);
        }
        return Ok(addrs);
    }
    if !extra.is_empty() {
        usage!("--discover takes the paths from the discovery log; leave out --path");
    }
    let addr = target_addr(f, DEFAULT_DISCOVERY_PORT)?;
    let opts = discovery_options(ctx, f, addr.clone())?;
    let log = discover(&opts)
        .await
        .with_context(|| format!("discovery at {addr} failed"))?;
    let addrs = paths_from_discovery(&log, nqn);
    if addrs.is_empty() {
        anyhow::bail!(nvmeof_initiator::Error::NoPath(format!(
            "the discovery log at {addr} lists no path to {nqn}"
        )));
    }
    Ok(addrs)
}

async fn cmd_list_paths(
    ctx: &Ctx,
    f: &Fabric,
    q: &QueueArgs,
    extra: &[String],
    from_discovery: bool,
    nsid: u32,
) -> Result<()> {
    let addrs = multipath_addrs(ctx, f, extra, from_discovery).await?;
    let mut template = f.clone();
    template.traddr = Some(addrs[0].host.clone());
    template.trsvcid = Some(addrs[0].port);
    let opts = direct_options(ctx, &template, q)?;
    let mp = Multipath::connect(opts, addrs, MultipathOptions::default())
        .await
        .context("no path connected")?;
    // The namespace's ANA group decides the current path.
    let group = match mp.namespace(nsid).await {
        Ok(ns) => Some(ns.ana_group()),
        Err(e) => {
            let _ = mp.clone().disconnect().await;
            return Err(e).with_context(|| format!("namespace {nsid}"));
        }
    };
    let paths = mp.paths_for_group(group.unwrap_or(0));
    let subnqn = mp.subnqn().to_string();
    let disconnect = mp.disconnect().await;
    match ctx.output {
        Output::Json => print_json(&json!({
            "subnqn": subnqn,
            "nsid": nsid,
            "ana_group": group,
            "paths": paths,
        })),
        Output::Normal => {
            println!(
                "{subnqn} namespace {nsid} (ANA group {})",
                group.unwrap_or(0)
            );
            for line in path_lines(&paths) {
                println!("{line}");
            }
        }
    }
    disconnect?;
    Ok(())
}

async fn cmd_probe(ctx: &Ctx, f: &Fabric, q: &QueueArgs) -> Result<()> {
    let opts = direct_options(ctx, f, q)?;
    let ctrl = connect_direct(opts).await?;
    let info = ctrl.info();
    let mut namespaces = Vec::new();
    for nsid in ctrl.namespace_ids() {
        match ctrl.namespace_info(nsid).await {
            Ok(n) => namespaces.push(n),
            Err(e) => {
                let _ = ctrl.clone().disconnect().await;
                return Err(e).with_context(|| format!("Identify Namespace {nsid}"));
            }
        }
    }
    let disconnect = ctrl.disconnect().await;
    match ctx.output {
        Output::Json => print_json(&json!({
            "controller": info,
            "namespaces": namespaces,
        })),
        Output::Normal => {
            println!("Controller {} at {}", info.cntlid, info.addr);
            println!("  subsystem:       {}", info.subnqn);
            println!("  model:           {}", info.model);
            println!("  serial:          {}", info.serial);
            println!("  firmware:        {}", info.firmware);
            println!("  NVMe version:    {}", info.version);
            println!(
                "  I/O queues:      {} x {} entries",
                info.io_queues, info.queue_depth
            );
            println!(
                "  max transfer:    {} (MDTS {})",
                human_size(u64::from(info.max_transfer_bytes)),
                info.mdts_bytes
                    .map_or_else(|| "unlimited".to_string(), human_size)
            );
            println!(
                "  in-capsule data: {}",
                human_size(u64::from(info.in_capsule_data_bytes))
            );
            println!("  keep alive:      {} ms", info.kato_ms);
            println!(
                "  digests:         header {}, data {}",
                on_off(info.header_digest),
                on_off(info.data_digest)
            );
            println!("  SQ flow control: {}", on_off(info.sq_flow_control));
            println!("  host NQN:        {}", info.hostnqn);
            println!("Namespaces:");
            println!(
                "  {:<6} {:>14} {:>12} {:>10}  NGUID",
                "NSID", "Blocks", "Size", "BlockSize"
            );
            for n in &namespaces {
                println!(
                    "  {:<6} {:>14} {:>12} {:>10}  {}",
                    n.nsid,
                    n.blocks,
                    human_size(n.size_bytes),
                    n.block_size,
                    n.nguid
                );
            }
        }
    }
    disconnect.context("disconnect")?;
    Ok(())
}

fn on_off(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// The parameters of an attachment of namespace `nsid` that the fabric and queue flags name.
fn attach_params(f: &Fabric, q: &QueueArgs, nsid: u32) -> Result<AttachParams> {
    if q.ctrl_loss_tmo.is_some() || q.reconnect_delay.is_some() {
        usage!(
            "--ctrl-loss-tmo and --reconnect-delay apply to one-off commands; nvmeof-initd \
             reconnects attachments on its own"
        );
    }
    let addr = target_addr(f, DEFAULT_PORT)?;
    let Some(subnqn) = f.nqn.clone() else {
        usage!("the subsystem NQN is missing (-n NQN)");
    };
    if let Some(id) = &f.hostid {
        if parse_hostid(id).is_none() {
            usage!("--hostid {id:?} is not a UUID");
        }
    }
    dhchap(f)?;
    tls(f)?;
    Ok(AttachParams {
        transport: addr.transport.as_str().to_string(),
        traddr: addr.host.clone(),
        trsvcid: addr.port,
        subnqn,
        nsid,
        hostnqn: f.hostnqn.clone(),
        hostid: f
            .hostid
            .as_deref()
            .and_then(parse_hostid)
            .map(|i| format_hostid(&i)),
        hdr_digest: f.hdr_digest,
        data_digest: f.data_digest,
        sq_flow_control: f.sq_flow_control,
        nr_io_queues: q.nr_io_queues,
        queue_size: q.queue_size,
        kato_ms: q.keep_alive_tmo.map(|s| s.saturating_mul(1000)),
        dhchap_secret: f.dhchap_secret.clone().map(KeyText),
        dhchap_ctrl_secret: f.dhchap_ctrl_secret.clone().map(KeyText),
        tls_key: f.tls_key.clone().map(KeyText),
        paths: Vec::new(),
    })
}

fn attached_line(a: &AttachmentStatus) -> String {
    format!(
        "attached {} -> {} nsid {} at {}://{}:{} ({})",
        a.name,
        a.params.subnqn,
        a.params.nsid,
        a.params.transport,
        a.params.traddr,
        a.params.trsvcid,
        a.state
    )
}

/// Adds the `--path` arguments to an attachment's parameters.
fn add_paths(params: &mut AttachParams, f: &Fabric, paths: &[String]) -> Result<()> {
    let t = check_transport(f)?;
    for p in paths {
        let a = parse_path(p, f.trsvcid.unwrap_or(DEFAULT_PORT), t)?;
        if a.host == params.traddr && a.port == params.trsvcid
            || params
                .paths
                .iter()
                .any(|q| q.traddr == a.host && q.trsvcid == a.port)
        {
            usage!("path {p} is given twice");
        }
        params.paths.push(PathAddr {
            traddr: a.host,
            trsvcid: a.port,
        });
    }
    Ok(())
}

async fn cmd_attach(
    ctx: &Ctx,
    name: &str,
    f: &Fabric,
    q: &QueueArgs,
    nsid: u32,
    paths: &[String],
) -> Result<()> {
    if !valid_name(name) {
        usage!("attachment name {name:?} must be 1-64 letters, digits, '.', '_' or '-'");
    }
    let mut params = attach_params(f, q, nsid)?;
    add_paths(&mut params, f, paths)?;
    let mut c = ctx.daemon().await?;
    let a = c.attach(name, params).await?;
    match ctx.output {
        Output::Json => print_json(&attachment_json(&a)),
        Output::Normal => println!("{}", attached_line(&a)),
    }
    Ok(())
}

/// Whether attachment `a` is namespace `nsid` of the subsystem and address of `p`.
fn same_namespace(a: &AttachmentStatus, p: &AttachParams, nsid: u32) -> bool {
    a.params.subnqn == p.subnqn
        && a.params.traddr == p.traddr
        && a.params.trsvcid == p.trsvcid
        && a.params.transport == p.transport
        && a.params.nsid == nsid
}

/// The first `nvmeofK` that no attachment name starts with `nvmeofKn`.
fn free_base(existing: &[AttachmentStatus]) -> String {
    (0u32..)
        .map(|k| format!("nvmeof{k}"))
        .find(|b| {
            let prefix = format!("{b}n");
            !existing
                .iter()
                .any(|a| a.name == *b || a.name.starts_with(&prefix))
        })
        .unwrap_or_else(|| "nvmeof".into())
}

/// What one `connect` did: the attachments made and those found already.
#[derive(Default)]
struct Connected {
    made: Vec<AttachmentStatus>,
    already: Vec<AttachmentStatus>,
}

/// nvme-cli's connect through nvmeof-initd: attaches namespace `nsid`, or every active one,
/// as `BASEn<NSID>`; all or nothing.
async fn connect_through_daemon(
    c: &mut DaemonClient,
    params: AttachParams,
    nsid: Option<u32>,
    base: Option<&str>,
) -> Result<Connected> {
    let existing = c.list().await?;
    let nsids = match nsid {
        Some(n) => vec![n],
        None => c.active_namespaces(params.clone()).await?,
    };
    if nsids.is_empty() {
        return Err(anyhow::Error::new(nvmeof_initiator::Error::ViaDaemon {
            class: nvmeof_initiator::ErrorClass::Target,
            message: format!("subsystem {} has no active namespace", params.subnqn),
        }));
    }
    let base = base.map_or_else(|| free_base(&existing), str::to_string);
    let mut done = Connected::default();
    for n in nsids {
        if let Some(a) = existing.iter().find(|a| same_namespace(a, &params, n)) {
            done.already.push(a.clone());
            continue;
        }
        let name = format!("{base}n{n}");
        if !valid_name(&name) {
            usage!("attachment name {name:?} must be 1-64 letters, digits, '.', '_' or '-'");
        }
        let p = AttachParams {
            nsid: n,
            ..params.clone()
        };
        match c.attach(&name, p).await {
            Ok(a) => done.made.push(a),
            Err(e) => {
                for a in &done.made {
                    let _ = c.detach(&a.name).await;
                }
                return Err(e.into());
            }
        }
    }
    Ok(done)
}

fn print_connected(ctx: &Ctx, done: &Connected) {
    match ctx.output {
        Output::Json => print_json(&json!({
            "attached": done.made.iter().map(attachment_json).collect::<Vec<_>>(),
            "already_attached": done.already.iter().map(attachment_json).collect::<Vec<_>>(),
        })),
        Output::Normal => {
            for a in &done.made {
                println!("{}", attached_line(a));
            }
            for a in &done.already {
                println!(
                    "already attached as {}: {} nsid {} ({})",
                    a.name, a.params.subnqn, a.params.nsid, a.state
                );
            }
        }
    }
}

async fn cmd_connect(
    ctx: &Ctx,
    f: &Fabric,
    q: &QueueArgs,
    nsid: Option<u32>,
    base: Option<&str>,
    paths: &[String],
) -> Result<()> {
    let mut params = attach_params(f, q, nsid.unwrap_or(1))?;
    add_paths(&mut params, f, paths)?;
    let mut c = ctx.daemon().await.context(
        "connect keeps the connection in nvmeof-initd (`nvmeof probe` looks at a subsystem \
         without it)",
    )?;
    let done = connect_through_daemon(&mut c, params, nsid, base).await?;
    print_connected(ctx, &done);
    Ok(())
}

async fn cmd_connect_all(ctx: &Ctx, f: &Fabric, q: &QueueArgs) -> Result<()> {
    if f.nqn.is_some() {
        usage!("connect-all connects to what the discovery log lists: -n is not taken");
    }
    let addr = target_addr(f, DEFAULT_DISCOVERY_PORT)?;
    let opts = discovery_options(ctx, f, addr.clone())?;
    let mut c = ctx.daemon().await?;
    let log = discover(&opts)
        .await
        .with_context(|| format!("discovery at {addr} failed"))?;
    let mut all = Connected::default();
    let mut failed: Option<anyhow::Error> = None;
    for e in &log.entries {
        // NVM subsystems only (not referrals to other discovery controllers).
        if e.subtype != 2 {
            continue;
        }
        let mut sub = f.clone();
        sub.transport = Some(e.trtype_name().to_string());
        sub.traddr = Some(e.traddr.clone());
        sub.trsvcid = Some(match e.trsvcid.parse() {
            Ok(p) => p,
            Err(_) => {
                eprintln!(
                    "nvmeof: {}: skipped: port {:?} is not a number",
                    e.subnqn, e.trsvcid
                );
                continue;
            }
        });
        sub.nqn = Some(e.subnqn.clone());
        let res = match attach_params(&sub, q, 1) {
            Ok(p) => connect_through_daemon(&mut c, p, None, None).await,
            Err(err) => Err(err),
        };
        match res {
            Ok(done) => {
                all.made.extend(done.made);
                all.already.extend(done.already);
            }
            Err(err) => {
                eprintln!("nvmeof: error: {}: {}", e.subnqn, one_line(&err));
                failed = Some(err);
            }
        }
    }
    print_connected(ctx, &all);
    match failed {
        Some(e) => Err(e.context("connect-all: not every subsystem could be connected")),
        None => Ok(()),
    }
}

async fn cmd_disconnect(
    ctx: &Ctx,
    name: Option<String>,
    nqn: Option<String>,
    device: Option<String>,
) -> Result<()> {
    // Either one attachment by name, or every attachment of a subsystem.
    let by_name = match (name.or(device), nqn) {
        (Some(n), None) => Ok(n),
        (None, Some(nqn)) => Err(nqn),
        (Some(_), Some(_)) => usage!("give either -n NQN or an attachment name, not both"),
        (None, None) => usage!(
            "say what to disconnect: -n NQN (every attachment of a subsystem) or -d NAME \
             (`nvmeof disconnect-all` disconnects everything)"
        ),
    };
    let mut c = ctx.daemon().await?;
    let names: Vec<String> = match by_name {
        Ok(n) => vec![n],
        Err(nqn) => {
            let names: Vec<String> = c
                .list()
                .await?
                .into_iter()
                .filter(|a| a.params.subnqn == nqn)
                .map(|a| a.name)
                .collect();
            if names.is_empty() {
                return Err(nvmeof_initiator::Error::Daemon(format!(
                    "no attachment of subsystem {nqn} (`nvmeof list-subsys` shows them)"
                ))
                .into());
            }
            names
        }
    };
    detach_all(ctx, &mut c, names).await
}

async fn cmd_disconnect_all(ctx: &Ctx) -> Result<()> {
    let mut c = ctx.daemon().await?;
    let names = c.list().await?.into_iter().map(|a| a.name).collect();
    detach_all(ctx, &mut c, names).await
}

async fn detach_all(ctx: &Ctx, c: &mut DaemonClient, names: Vec<String>) -> Result<()> {
    for n in &names {
        c.detach(n).await?;
        if ctx.output == Output::Normal {
            println!("detached {n}");
        }
    }
    if ctx.output == Output::Json {
        print_json(&json!({ "detached": names }));
    }
    Ok(())
}

async fn cmd_list_subsys(ctx: &Ctx) -> Result<()> {
    let mut c = ctx.daemon().await?;
    let list = c.list().await?;
    let mut subsystems: std::collections::BTreeMap<&str, Vec<&AttachmentStatus>> =
        std::collections::BTreeMap::new();
    for a in &list {
        subsystems.entry(&a.params.subnqn).or_default().push(a);
    }
    match ctx.output {
        Output::Json => {
            let v: Vec<Value> = subsystems
                .iter()
                .map(|(nqn, attachments)| {
                    json!({
                        "nqn": nqn,
                        "attachments": attachments
                            .iter()
                            .map(|a| attachment_json(a))
                            .collect::<Vec<_>>(),
                    })
                })
                .collect();
            print_json(&json!({ "subsystems": v }));
        }
        Output::Normal => {
            for (nqn, attachments) in &subsystems {
                println!("{nqn}");
                for a in attachments {
                    println!(
                        " +- {} {} traddr={} trsvcid={} nsid {} {}",
                        a.name,
                        a.params.transport,
                        a.params.traddr,
                        a.params.trsvcid,
                        a.params.nsid,
                        a.state
                    );
                }
            }
        }
    }
    Ok(())
}

fn attachment_json(a: &AttachmentStatus) -> Value {
    json!({
        "name": a.name,
        "subsystem": a.params.subnqn,
        "nsid": a.params.nsid,
        "transport": a.params.transport,
        "traddr": a.params.traddr,
        // A string, as nvme-cli and the discovery log have it.
        "trsvcid": a.params.trsvcid.to_string(),
        "size_bytes": a.namespace.as_ref().map(|n| n.size_bytes),
        "blocks": a.namespace.as_ref().map(|n| n.blocks),
        "block_size": a.namespace.as_ref().map(|n| n.block_size),
        "model": a.controller.as_ref().map(|c| c.model.clone()),
        "serial": a.controller.as_ref().map(|c| c.serial.clone()),
        "cntlid": a.controller.as_ref().map(|c| c.cntlid),
        "state": a.state,
        "last_error": a.last_error,
        "hostnqn": a.params.hostnqn,
        "paths": a.paths,
    })
}

/// The lines `list` and `list-paths` print for the paths of a multipath attachment: one
/// per path, `*` marking the one I/O takes now.
fn path_lines(paths: &[PathInfo]) -> Vec<String> {
    paths
        .iter()
        .map(|p| {
            let state = match &p.state {
                None => format!(
                    "not connected ({})",
                    p.error.as_deref().unwrap_or("connecting")
                ),
                Some(ControllerState::Connected) => "live".to_string(),
                Some(ControllerState::Reconnecting { attempt, .. }) => {
                    format!("reconnecting (attempt {attempt})")
                }
                Some(ControllerState::Failed { error }) => format!("failed ({error})"),
                Some(ControllerState::Closed) => "closed".to_string(),
            };
            let ana = if !p.ana_reporting {
                "no ANA (counts as optimized)".to_string()
            } else {
                p.ana
                    .iter()
                    .map(|g| format!("group {} {}", g.group, g.state))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            format!(
                "{} {} cntlid {} {state}, {ana}",
                if p.current { "*" } else { " " },
                p.addr,
                p.cntlid.map_or_else(|| "-".to_string(), |c| c.to_string()),
            )
        })
        .collect()
}

async fn cmd_list(ctx: &Ctx) -> Result<()> {
    let mut c = ctx.daemon().await?;
    let list = c.list().await?;
    match ctx.output {
        Output::Json => {
            let devices: Vec<Value> = list.iter().map(attachment_json).collect();
            print_json(&json!({ "devices": devices }));
        }
        Output::Normal => {
            println!(
                "{:<16} {:<44} {:>5} {:>12} {:>9} {:<24} State",
                "Name", "Subsystem", "NSID", "Size", "BlockSize", "Model"
            );
            println!("{}", "-".repeat(126));
            for a in &list {
                let size = a
                    .namespace
                    .as_ref()
                    .map_or_else(|| "-".to_string(), |n| human_size(n.size_bytes));
                let bs = a
                    .namespace
                    .as_ref()
                    .map_or_else(|| "-".to_string(), |n| n.block_size.to_string());
                let model = a
                    .controller
                    .as_ref()
                    .map_or_else(|| "-".to_string(), |c| c.model.clone());
                let state = match &a.last_error {
                    Some(e) if a.state != "connected" => format!("{} ({e})", a.state),
                    _ => a.state.clone(),
                };
                println!(
                    "{:<16} {:<44} {:>5} {:>12} {:>9} {:<24} {}",
                    a.name, a.params.subnqn, a.params.nsid, size, bs, model, state
                );
                for line in path_lines(&a.paths) {
                    println!("    path {line}");
                }
            }
        }
    }
    Ok(())
}

/// A field of an Identify structure: its name and value, in the specification's order.
type Field = (&'static str, Value);

/// Identify Controller fields in the order of NVMe Base 2.0, Figure 275.
fn id_ctrl_fields(id: &IdentifyController) -> Vec<Field> {
    vec![
        ("vid", json!(id.vid.get())),
        ("ssvid", json!(id.ssvid.get())),
        ("sn", json!(get_trimmed(&id.sn))),
        ("mn", json!(get_trimmed(&id.mn))),
        ("fr", json!(get_trimmed(&id.fr))),
        ("rab", json!(id.rab)),
        (
            "ieee",
            json!(u32::from_le_bytes([id.ieee[0], id.ieee[1], id.ieee[2], 0])),
        ),
        ("cmic", json!(id.cmic)),
        ("mdts", json!(id.mdts)),
        ("cntlid", json!(id.cntlid.get())),
        ("ver", json!(id.ver.get())),
        ("oaes", json!(id.oaes.get())),
        ("ctratt", json!(id.ctratt.get())),
        ("cntrltype", json!(id.cntrltype)),
        ("oacs", json!(id.oacs.get())),
        ("acl", json!(id.acl)),
        ("aerl", json!(id.aerl)),
        ("frmw", json!(id.frmw)),
        ("lpa", json!(id.lpa)),
        ("elpe", json!(id.elpe)),
        ("npss", json!(id.npss)),
        ("kas", json!(id.kas.get())),
        ("sqes", json!(id.sqes)),
        ("cqes", json!(id.cqes)),
        ("maxcmd", json!(id.maxcmd.get())),
        ("nn", json!(id.nn.get())),
        ("oncs", json!(id.oncs.get())),
        ("fuses", json!(id.fuses.get())),
        ("fna", json!(id.fna)),
        ("vwc", json!(id.vwc)),
        ("awun", json!(id.awun.get())),
        ("awupf", json!(id.awupf.get())),
        ("sgls", json!(id.sgls.get())),
        ("mnan", json!(id.mnan.get())),
        ("subnqn", json!(get_trimmed(&id.subnqn))),
        ("ioccsz", json!(id.ioccsz.get())),
        ("iorcsz", json!(id.iorcsz.get())),
        ("icdoff", json!(id.icdoff.get())),
        ("fcatt", json!(id.fcatt)),
        ("msdbd", json!(id.msdbd)),
        ("ofcs", json!(id.ofcs.get())),
    ]
}

/// `-H` decoding of a few Identify Controller fields.
fn id_ctrl_human(id: &IdentifyController, mdts_bytes: Option<u64>, name: &str) -> Vec<String> {
    let bits = |v: u32, names: &[(u32, &str)]| -> Vec<String> {
        names
            .iter()
            .map(|&(bit, what)| {
                let yes = if v & (1 << bit) != 0 { "" } else { "not " };
                format!("[{bit}] {what} {yes}supported")
            })
            .collect()
    };
    match name {
        "ver" => vec![format!("NVMe {}", version_string(id.ver.get()))],
        "mdts" => vec![mdts_bytes.map_or_else(
            || "no transfer size limit".into(),
            |b| format!("max transfer {}", human_size(b)),
        )],
        "cntrltype" => vec![
            match id.cntrltype {
                1 => "I/O controller",
                2 => "discovery controller",
                3 => "administrative controller",
                _ => "controller type not reported",
            }
            .into(),
        ],
        "kas" => vec![format!(
            "keep alive granularity {} ms",
            u32::from(id.kas.get()) * 100
        )],
        "oncs" => bits(
            u32::from(id.oncs.get()),
            &[
                (0, "Compare"),
                (1, "Write Uncorrectable"),
                (2, "Dataset Management"),
                (3, "Write Zeroes"),
                (4, "Save/Select in Features"),
                (5, "Reservations"),
                (6, "Timestamp"),
                (7, "Verify"),
            ],
        ),
        "vwc" => vec![
            if id.vwc & 1 != 0 {
                "volatile write cache present (flush makes writes durable)"
            } else {
                "no volatile write cache"
            }
            .into(),
        ],
        "sgls" => vec![
            match id.sgls.get() & 3 {
                0 => "SGLs not supported",
                1 => "SGLs supported (no alignment requirement)",
                2 => "SGLs supported (dword aligned)",
                _ => "SGL support reserved value",
            }
            .into(),
        ],
        _ => Vec::new(),
    }
}

/// Identify Namespace fields in the order of NVM Command Set 1.0, Figure 97.
fn id_ns_fields(id: &IdentifyNamespace, nsid: u32) -> Vec<Field> {
    let lbafs: Vec<Value> = id
        .lbaf
        .iter()
        .take(usize::from(id.nlbaf) + 1)
        .map(|f| json!({ "ms": f.ms.get(), "ds": f.lbads, "rp": f.rp }))
        .collect();
    vec![
        ("nsid", json!(nsid)),
        ("nsze", json!(id.nsze.get())),
        ("ncap", json!(id.ncap.get())),
        ("nuse", json!(id.nuse.get())),
        ("nsfeat", json!(id.nsfeat)),
        ("nlbaf", json!(id.nlbaf)),
        ("flbas", json!(id.flbas)),
        ("mc", json!(id.mc)),
        ("dpc", json!(id.dpc)),
        ("dps", json!(id.dps)),
        ("nmic", json!(id.nmic)),
        ("rescap", json!(id.rescap)),
        ("dlfeat", json!(id.dlfeat)),
        ("nguid", json!(hex_id(&id.nguid))),
        ("eui64", json!(hex_id(&id.eui64))),
        ("lbafs", json!(lbafs)),
        ("block_size", json!(id.block_size())),
    ]
}

/// `-H` decoding of a few Identify Namespace fields.
fn id_ns_human(id: &IdentifyNamespace, name: &str) -> Vec<String> {
    let bs = u64::from(id.block_size());
    let size = |blocks: u64| {
        format!(
            "{} ({} blocks of {bs} bytes)",
            human_size(blocks * bs),
            blocks
        )
    };
    match name {
        "nsze" => vec![format!("size {}", size(id.nsze.get()))],
        "ncap" => vec![format!("capacity {}", size(id.ncap.get()))],
        "nuse" => vec![format!("in use {}", size(id.nuse.get()))],
        "nsfeat" => vec![format!(
            "[0] thin provisioning {}supported",
            if id.nsfeat & 1 != 0 { "" } else { "not " }
        )],
        "flbas" => vec![format!("LBA format {} in use", id.flbas & 0xF)],
        _ => Vec::new(),
    }
}

/// JSON of fields (object keys are sorted; the order of the fields is the normal output's).
fn fields_json(fields: Vec<Field>) -> Value {
    Value::Object(
        fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
    )
}

/// Prints fields as nvme-cli does, one `name : value` line each, numbers in hex and decimal,
/// LBA formats one per line; `human` adds decoded lines under a field.
fn print_fields(fields: &[Field], in_use_lbaf: Option<usize>, human: &dyn Fn(&str) -> Vec<String>) {
    for (k, val) in fields {
        match val {
            Value::String(s) => println!("{k:<10}: {s}"),
            Value::Number(n) => match n.as_u64() {
                Some(u) => println!("{k:<10}: {u:#x} ({u})"),
                None => println!("{k:<10}: {n}"),
            },
            Value::Array(list) => {
                for (i, f) in list.iter().enumerate() {
                    let used = if Some(i) == in_use_lbaf {
                        " (in use)"
                    } else {
                        ""
                    };
                    println!(
                        "lbaf {i:>2}   : ms:{:<4} lbads:{:<3} rp:{}{used}",
                        f["ms"], f["ds"], f["rp"]
                    );
                }
            }
            other => println!("{k:<10}: {other}"),
        }
        for line in human(k) {
            println!("  {line}");
        }
    }
}

async fn connect_for(
    ctx: &Ctx,
    name: Option<&str>,
    f: &Fabric,
    q: &QueueArgs,
) -> Result<(Controller, Option<u32>)> {
    let (mut opts, nsid) = resolve(ctx, name, f, q).await?;
    if q.nr_io_queues.is_none() {
        opts.io_queues = Some(1);
    }
    let loss = opts.reconnect.ctrl_loss_timeout;
    let ctrl = connect_direct(opts).await?;
    report_reconnects(&ctrl, loss);
    Ok((ctrl, nsid))
}

async fn cmd_id_ctrl(ctx: &Ctx, name: Option<&str>, f: &Fabric, human: bool) -> Result<()> {
    let q = QueueArgs {
        nr_io_queues: Some(0),
        ..QueueArgs::default()
    };
    let (ctrl, _) = connect_for(ctx, name, f, &q).await?;
    let mdts = ctrl.info().mdts_bytes;
    let id = ctrl.identify_controller().await;
    let _ = ctrl.disconnect().await;
    let id = id.context("Identify Controller")?;
    let fields = id_ctrl_fields(&id);
    match ctx.output {
        Output::Json => print_json(&fields_json(fields)),
        Output::Normal => {
            println!("NVME Identify Controller:");
            let decode = |k: &str| {
                if human {
                    id_ctrl_human(&id, mdts, k)
                } else {
                    Vec::new()
                }
            };
            print_fields(&fields, None, &decode);
        }
    }
    Ok(())
}

async fn cmd_id_ns(
    ctx: &Ctx,
    name: Option<&str>,
    f: &Fabric,
    nsid: Option<u32>,
    human: bool,
) -> Result<()> {
    let q = QueueArgs {
        nr_io_queues: Some(0),
        ..QueueArgs::default()
    };
    let (ctrl, attached) = connect_for(ctx, name, f, &q).await?;
    let nsid = nsid.or(attached).unwrap_or(1);
    let id = ctrl.identify_namespace(nsid).await;
    let _ = ctrl.disconnect().await;
    let id = id.with_context(|| format!("Identify Namespace {nsid}"))?;
    let fields = id_ns_fields(&id, nsid);
    match ctx.output {
        Output::Json => print_json(&fields_json(fields)),
        Output::Normal => {
            println!("NVME Identify Namespace {nsid}:");
            let decode = |k: &str| {
                if human {
                    id_ns_human(&id, k)
                } else {
                    Vec::new()
                }
            };
            print_fields(&fields, Some(usize::from(id.flbas & 0xF)), &decode);
        }
    }
    Ok(())
}

/// Progress on stderr when it is a terminal.
struct Progress {
    enabled: bool,
    what: &'static str,
    total: u64,
    last: Instant,
}

impl Progress {
    fn new(what: &'static str, total: u64) -> Self {
        Progress {
            enabled: std::io::stderr().is_terminal() && total >= (4 << 20),
            what,
            total,
            last: Instant::now(),
        }
    }

    fn update(&mut self, done: u64) {
        if !self.enabled || (self.last.elapsed() < Duration::from_millis(200) && done < self.total)
        {
            return;
        }
        self.last = Instant::now();
        let pct = (done * 100).checked_div(self.total).unwrap_or(100);
        eprint!(
            "\r{} {} / {} ({pct}%)   ",
            self.what,
            human_size(done),
            human_size(self.total)
        );
        let _ = std::io::stderr().flush();
    }

    fn finish(&mut self) {
        if self.enabled {
            eprintln!();
        }
    }
}

/// Bytes per library call for CLI transfers.
const CLI_CHUNK: usize = 8 << 20;

async fn open_namespace(
    ctx: &Ctx,
    name: Option<&str>,
    f: &Fabric,
    q: &QueueArgs,
    nsid: Option<u32>,
) -> Result<Namespace> {
    let (ctrl, attached) = connect_for(ctx, name, f, q).await?;
    let nsid = nsid.or(attached).unwrap_or(1);
    match ctrl.namespace(nsid).await {
        Ok(ns) => Ok(ns),
        Err(e) => {
            let _ = ctrl.disconnect().await;
            Err(e).with_context(|| format!("namespace {nsid}"))
        }
    }
}

/// `n` and the noun, plural unless `n` is 1.
fn count_of(n: u64, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

fn summary(
    ctx: &Ctx,
    op: &str,
    ns: &Namespace,
    start: u64,
    blocks: u64,
    elapsed: Duration,
    data_on_stdout: bool,
) {
    let bytes = blocks * u64::from(ns.block_size());
    // Decimal megabytes per second, as dd and fio print them.
    let mb_per_s = bytes as f64 / elapsed.as_secs_f64().max(1e-6) / 1e6;
    match ctx.output {
        Output::Json => {
            let v = json!({
                "operation": op,
                "nsid": ns.nsid(),
                "start_block": start,
                "blocks": blocks,
                "block_size": ns.block_size(),
                "bytes": bytes,
                "elapsed_ms": elapsed.as_millis() as u64,
                "mb_per_s": (mb_per_s * 100.0).round() / 100.0,
            });
            if data_on_stdout {
                eprintln!("{v}");
            } else {
                print_json(&v);
            }
        }
        Output::Normal => eprintln!(
            "{op}: {} ({}) at block {start} of namespace {} in {:.3} s, {mb_per_s:.1} MB/s",
            count_of(blocks, "block"),
            human_size(bytes),
            ns.nsid(),
            elapsed.as_secs_f64()
        ),
    }
}

fn is_std(p: &Option<PathBuf>) -> bool {
    p.as_deref().is_none_or(|p| p.as_os_str() == "-")
}

async fn cmd_read(
    ctx: &Ctx,
    name: Option<&str>,
    f: &Fabric,
    q: &QueueArgs,
    r: &RangeArgs,
) -> Result<()> {
    r.refuse_nvme_cli_flags()?;
    if r.blocks.is_none() && r.data_size.is_none() {
        usage!("say how much to read: --blocks N or --data-size BYTES");
    }
    let ns = open_namespace(ctx, name, f, q, r.namespace_id).await?;
    let res = async {
        let blocks = r.count(u64::from(ns.block_size()))?.unwrap_or(0);
        check_range(&ns, r.start_block, blocks)?;
        do_read(ctx, &ns, r, blocks).await
    }
    .await;
    let _ = ns.controller().clone().disconnect().await;
    res
}

/// Checks that `blocks` blocks from `start` lie inside the namespace, before any transfer.
fn check_range(ns: &Namespace, start: u64, blocks: u64) -> Result<()> {
    let bs = u64::from(ns.block_size());
    let size = ns.size_bytes() / bs;
    match start.checked_add(blocks) {
        Some(end) if end <= size => Ok(()),
        _ => usage!(
            "blocks {start}..{} are outside namespace {}: it has {size} blocks of {bs} bytes \
             ({})",
            start.saturating_add(blocks),
            ns.nsid(),
            human_size(ns.size_bytes())
        ),
    }
}

/// A file written under a temporary name in its directory and renamed to its own name only
/// when complete; removed if dropped before.
struct NewFile {
    file: Option<File>,
    tmp: PathBuf,
    path: PathBuf,
}

impl NewFile {
    fn create(path: &std::path::Path) -> Result<NewFile> {
        let name = path
            .file_name()
            .with_context(|| format!("{} is not a file name", path.display()))?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".nvmeof-{}.tmp", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| {
                let dir = match path.parent() {
                    Some(d) if !d.as_os_str().is_empty() => d,
                    _ => std::path::Path::new("."),
                };
                let why = match std::fs::metadata(dir) {
                    Err(m) if m.kind() == std::io::ErrorKind::NotFound => {
                        format!("directory {} does not exist", dir.display())
                    }
                    Ok(m) if !m.is_dir() => format!("{} is not a directory", dir.display()),
                    _ => e.to_string(),
                };
                anyhow::anyhow!("cannot create {}: {why}", path.display())
            })?;
        Ok(NewFile {
            file: Some(file),
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// Flushes the data to the file system and gives the file its name.
    fn commit(mut self) -> Result<()> {
        let file = self.file.take().expect("not committed twice");
        file.sync_all()
            .with_context(|| format!("cannot write {}", self.tmp.display()))?;
        std::fs::rename(&self.tmp, &self.path)
            .with_context(|| format!("cannot rename the output to {}", self.path.display()))
    }
}

impl Write for NewFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.as_mut().map_or(Ok(0), |f| f.write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.as_mut().map_or(Ok(()), |f| f.flush())
    }
}

impl Drop for NewFile {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

async fn do_read(ctx: &Ctx, ns: &Namespace, r: &RangeArgs, blocks: u64) -> Result<()> {
    let bs = u64::from(ns.block_size());
    let total = blocks * bs;
    let mut file = None;
    let mut stdout;
    let out: &mut dyn Write = if is_std(&r.data) {
        stdout = std::io::stdout().lock();
        &mut stdout
    } else {
        let p = r.data.as_deref().unwrap_or(std::path::Path::new("-"));
        file.insert(NewFile::create(p)?)
    };
    let chunk_blocks = (CLI_CHUNK as u64 / bs).max(1);
    let mut buf = vec![0u8; (chunk_blocks.min(blocks) * bs) as usize];
    let mut progress = Progress::new("read", total);
    let start = Instant::now();
    let mut done = 0u64;
    while done < blocks {
        let n = chunk_blocks.min(blocks - done);
        let len = (n * bs) as usize;
        let lba = r.start_block + done;
        ns.read(lba, &mut buf[..len])
            .await
            .with_context(|| format!("read of {} at block {lba}", count_of(n, "block")))?;
        out.write_all(&buf[..len])
            .context("cannot write the output")?;
        done += n;
        progress.update(done * bs);
    }
    out.flush().context("cannot write the output")?;
    if let Some(f) = file {
        f.commit()?;
    }
    progress.finish();
    summary(
        ctx,
        "read",
        ns,
        r.start_block,
        blocks,
        start.elapsed(),
        is_std(&r.data),
    );
    Ok(())
}

async fn cmd_write(
    ctx: &Ctx,
    name: Option<&str>,
    f: &Fabric,
    q: &QueueArgs,
    r: &RangeArgs,
    durability: Durability,
) -> Result<()> {
    r.refuse_nvme_cli_flags()?;
    let ns = open_namespace(ctx, name, f, q, r.namespace_id).await?;
    let res = do_write(ctx, &ns, r, durability).await;
    let _ = ns.controller().clone().disconnect().await;
    res
}

async fn do_write(ctx: &Ctx, ns: &Namespace, r: &RangeArgs, durability: Durability) -> Result<()> {
    let bs = u64::from(ns.block_size());
    let blocks = r.count(bs)?;
    let (mut input, size): (Box<dyn Read>, Option<u64>) = if is_std(&r.data) {
        (Box::new(std::io::stdin().lock()), None)
    } else {
        let p = r.data.as_deref().unwrap_or(std::path::Path::new("-"));
        let f = File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
        let len = f.metadata().ok().filter(|m| m.is_file()).map(|m| m.len());
        (Box::new(f), len)
    };
    let blocks = match (blocks, size) {
        (Some(b), _) => b,
        (None, Some(s)) => {
            if s % bs != 0 {
                usage!(
                    "the input has {s} bytes, not a multiple of the block size {bs}; give --blocks N"
                );
            }
            s / bs
        }
        (None, None) => {
            usage!("say how much to write from stdin: --blocks N or --data-size BYTES")
        }
    };
    if blocks == 0 {
        usage!("nothing to write (0 blocks)");
    }
    check_range(ns, r.start_block, blocks)?;
    let total = blocks * bs;
    if let Some(s) = size.filter(|&s| s < total) {
        usage!(
            "the input has {s} bytes, fewer than the {total} of {}",
            count_of(blocks, "block")
        );
    }
    let chunk_blocks = (CLI_CHUNK as u64 / bs).max(1);
    let mut buf = vec![0u8; (chunk_blocks.min(blocks) * bs) as usize];
    let mut progress = Progress::new("write", total);
    let start = Instant::now();
    let mut done = 0u64;
    while done < blocks {
        let n = chunk_blocks.min(blocks - done);
        let len = (n * bs) as usize;
        read_full(&mut input, &mut buf[..len]).with_context(|| {
            format!(
                "the input ended before {total} bytes ({}) were read",
                count_of(blocks, "block")
            )
        })?;
        let lba = r.start_block + done;
        let data = &buf[..len];
        let written = if durability.force_unit_access {
            ns.write_fua(lba, data).await
        } else {
            ns.write(lba, data).await
        };
        written.with_context(|| format!("write of {} at block {lba}", count_of(n, "block")))?;
        done += n;
        progress.update(done * bs);
    }
    progress.finish();
    if durability.flush {
        ns.flush().await.context("flush")?;
    }
    summary(
        ctx,
        "write",
        ns,
        r.start_block,
        blocks,
        start.elapsed(),
        false,
    );
    Ok(())
}

fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        match r.read(&mut buf[off..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => off += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
