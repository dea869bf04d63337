//! `nvmeof`: discover, connect to, inspect, read and write NVMe-oF namespaces from user space,
//! and manage the named attachments held by `nvmeof-initd`.

use std::fs::File;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use nvmeof_initiator::daemon::{self, AttachParams, AttachmentStatus, DaemonClient};
use nvmeof_initiator::identity::{format_hostid, parse_hostid};
use nvmeof_initiator::nvme_spec::identify::{IdentifyController, IdentifyNamespace, get_trimmed};
use nvmeof_initiator::{
    ConnectOptions, Controller, DEFAULT_DISCOVERY_PORT, DEFAULT_PORT, DiscoveryOptions,
    HostIdentity, Namespace, ReconnectPolicy, TargetAddr, Transport, default_state_dir, discover,
    hex_id, version_string,
};
use serde_json::{Value, json};

const ABOUT: &str = "User-space NVMe over Fabrics (NVMe/TCP) initiator";

const LONG_ABOUT: &str = "\
User-space NVMe over Fabrics (NVMe/TCP) initiator.

Talks to NVMe-oF targets directly from user space (no kernel nvme-tcp module needed):
discover subsystems, connect and inspect controllers and namespaces, read and write blocks.
Named attachments are kept connected by the nvmeof-initd daemon; programs using the
nvmeof-initiator library open them by name and do their own I/O.

Flags follow nvme-cli: -t tcp -a ADDRESS -s PORT -n SUBSYSTEM-NQN, --hostnqn, --hostid,
-o json|normal.

Examples:
  nvmeof discover -t tcp -a 192.0.2.10 -s 4420
  nvmeof connect -t tcp -a 192.0.2.10 -s 4420 -n nqn.2026-11.io.nvmeof-direct:default
  nvmeof read -t tcp -a 192.0.2.10 -s 4420 -n NQN --namespace-id 1 \\
      --start-block 0 --block-count 256 --data blocks.bin
  nvmeof attach data0 -t tcp -a 192.0.2.10 -s 4420 -n NQN --namespace-id 1
  nvmeof list
  nvmeof read data0 --start-block 0 --block-count 8 --data - | hexdump -C";

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
    /// The nvmeof-initd socket (for attach, detach, list and attachment names).
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
every entry: which subsystems this host may connect to, and where."
    )]
    Discover {
        #[command(flatten)]
        fabric: Fabric,
    },
    /// Connect to a subsystem, print its controller and namespaces, disconnect.
    #[command(
        long_about = "A one-off connection: sets up the admin queue and the I/O queues, \
prints what Identify Controller and Identify Namespace report, then disconnects gracefully. \
Nothing is kept; use `attach` for a lasting connection."
    )]
    Connect {
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
-a/-s/-n."
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
    },
    /// Remove an attachment from nvmeof-initd and disconnect it.
    Detach {
        /// Attachment name.
        name: String,
    },
    /// List the attachments held by nvmeof-initd and their health.
    List,
    /// Print Identify Controller.
    IdCtrl {
        /// An attachment name (instead of -a/-s/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
    },
    /// Print Identify Namespace.
    IdNs {
        /// An attachment name (instead of -a/-s/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        /// Namespace (default: the attachment's, or 1).
        #[arg(long = "namespace-id", value_name = "NSID")]
        namespace_id: Option<u32>,
    },
    /// Read blocks into a file or stdout.
    #[command(
        long_about = "Reads --block-count blocks starting at --start-block and writes them to \
--data (a file, or - / nothing for stdout). Progress is shown on a terminal."
    )]
    Read {
        /// An attachment name (instead of -a/-s/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
        #[command(flatten)]
        range: RangeArgs,
        /// Number of blocks to read.
        #[arg(long = "block-count", value_name = "N")]
        block_count: u64,
    },
    /// Write blocks from a file or stdin.
    #[command(
        long_about = "Writes blocks starting at --start-block from --data (a file, or - / \
nothing for stdin). Without --block-count the whole file is written (its size must be a \
multiple of the block size). Progress is shown on a terminal."
    )]
    Write {
        /// An attachment name (instead of -a/-s/-n).
        name: Option<String>,
        #[command(flatten)]
        fabric: Fabric,
        #[command(flatten)]
        queues: QueueArgs,
        #[command(flatten)]
        range: RangeArgs,
        /// Number of blocks to write (default: the size of --data).
        #[arg(long = "block-count", value_name = "N")]
        block_count: Option<u64>,
        #[command(flatten)]
        durability: Durability,
    },
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
    /// Transport type: `tcp` or `rdma` (NVMe/RDMA needs rdma-core and an RDMA device).
    #[arg(
        short = 't',
        long = "transport",
        default_value = "tcp",
        value_name = "TRTYPE"
    )]
    transport: String,
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
    /// Seconds to wait for the connection and for each admin command.
    #[arg(long = "timeout", default_value_t = 10, value_name = "SECS")]
    timeout: u64,
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
}

#[derive(Args, Clone)]
struct RangeArgs {
    /// Namespace (default: the attachment's, or 1).
    #[arg(long = "namespace-id", value_name = "NSID")]
    namespace_id: Option<u32>,
    /// First block.
    #[arg(long = "start-block", default_value_t = 0, value_name = "LBA")]
    start_block: u64,
    /// File to read from or write to; `-` or absent: stdin/stdout.
    #[arg(short = 'd', long = "data", value_name = "FILE")]
    data: Option<PathBuf>,
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
            // One line: the error and its causes.
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("nvmeof: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

struct Ctx {
    output: Output,
    socket: PathBuf,
    state_dir: PathBuf,
}

async fn run(cli: Cli) -> Result<()> {
    let ctx = Ctx {
        output: cli.output,
        socket: cli.socket.unwrap_or_else(daemon::default_socket_path),
        state_dir: cli.state_dir.unwrap_or_else(default_state_dir),
    };
    match cli.cmd {
        Cmd::Discover { fabric } => cmd_discover(&ctx, &fabric).await,
        Cmd::Connect { fabric, queues } => cmd_connect(&ctx, &fabric, &queues).await,
        Cmd::Attach {
            name,
            fabric,
            queues,
            namespace_id,
        } => cmd_attach(&ctx, &name, &fabric, &queues, namespace_id).await,
        Cmd::Detach { name } => {
            let mut c = DaemonClient::connect(&ctx.socket).await?;
            c.detach(&name).await?;
            match ctx.output {
                Output::Json => print_json(&json!({ "detached": name })),
                Output::Normal => println!("detached {name}"),
            }
            Ok(())
        }
        Cmd::List => cmd_list(&ctx).await,
        Cmd::IdCtrl { name, fabric } => cmd_id_ctrl(&ctx, name.as_deref(), &fabric).await,
        Cmd::IdNs {
            name,
            fabric,
            namespace_id,
        } => cmd_id_ns(&ctx, name.as_deref(), &fabric, namespace_id).await,
        Cmd::Read {
            name,
            fabric,
            queues,
            range,
            block_count,
        } => cmd_read(&ctx, name.as_deref(), &fabric, &queues, &range, block_count).await,
        Cmd::Write {
            name,
            fabric,
            queues,
            range,
            block_count,
            durability,
        } => {
            cmd_write(
                &ctx,
                name.as_deref(),
                &fabric,
                &queues,
                &range,
                block_count,
                durability,
            )
            .await
        }
    }
}

fn print_json(v: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

fn identity(ctx: &Ctx, f: &Fabric) -> Result<HostIdentity> {
    let parse = |s: &str| parse_hostid(s).ok_or_else(|| anyhow!("--hostid {s:?} is not a UUID"));
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
    let t: Transport = f.transport.parse()?;
    if t == Transport::Rdma && (f.hdr_digest || f.data_digest) {
        bail!("digests (-g, -G) are an NVMe/TCP feature; NVMe/RDMA has none");
    }
    Ok(t)
}

fn target_addr(f: &Fabric, default_port: u16) -> Result<TargetAddr> {
    let t = check_transport(f)?;
    let a = f
        .traddr
        .as_deref()
        .ok_or_else(|| anyhow!("the target address is missing (-a ADDRESS)"))?;
    Ok(TargetAddr::new(a, f.trsvcid.unwrap_or(default_port)).with_transport(t))
}

fn direct_options(ctx: &Ctx, f: &Fabric, q: &QueueArgs) -> Result<ConnectOptions> {
    let addr = target_addr(f, DEFAULT_PORT)?;
    let nqn = f
        .nqn
        .as_deref()
        .ok_or_else(|| anyhow!("the subsystem NQN is missing (-n NQN)"))?;
    let mut o = ConnectOptions::new(addr, nqn, identity(ctx, f)?);
    o.header_digest = f.hdr_digest;
    o.data_digest = f.data_digest;
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
    o.timeouts.io = o.timeouts.io.max(t);
    // A one-off command does not wait long for a target that went away.
    o.reconnect = ReconnectPolicy {
        ctrl_loss_timeout: Some(Duration::from_secs(10)),
        ..ReconnectPolicy::default()
    };
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
            if f.traddr.is_some() || f.nqn.is_some() {
                bail!("give either an attachment name or -a/-n, not both");
            }
            let (mut o, nsid) = daemon::attached_options(&ctx.socket, name).await?;
            if f.hdr_digest {
                o.header_digest = true;
            }
            if f.data_digest {
                o.data_digest = true;
            }
            apply_queue_args(&mut o, q, f.timeout);
            Ok((o, Some(nsid)))
        }
        None => Ok((direct_options(ctx, f, q)?, None)),
    }
}

async fn cmd_discover(ctx: &Ctx, f: &Fabric) -> Result<()> {
    let addr = target_addr(f, DEFAULT_DISCOVERY_PORT)?;
    let mut opts = DiscoveryOptions::new(addr.clone(), identity(ctx, f)?);
    opts.header_digest = f.hdr_digest;
    opts.data_digest = f.data_digest;
    let t = Duration::from_secs(f.timeout.max(1));
    opts.timeouts.connect = t;
    opts.timeouts.admin = t;
    let log = discover(&opts)
        .await
        .with_context(|| format!("discovery at {addr} failed"))?;
    match ctx.output {
        Output::Json => {
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
            print_json(&json!({ "genctr": log.genctr, "records": records }));
        }
        Output::Normal => {
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
    }
    Ok(())
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

async fn cmd_connect(ctx: &Ctx, f: &Fabric, q: &QueueArgs) -> Result<()> {
    let opts = direct_options(ctx, f, q)?;
    let addr = opts.addr.clone();
    let ctrl = Controller::connect(opts)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
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

async fn cmd_attach(ctx: &Ctx, name: &str, f: &Fabric, q: &QueueArgs, nsid: u32) -> Result<()> {
    if !valid_name(name) {
        bail!("attachment name {name:?} must be 1-64 letters, digits, '.', '_' or '-'");
    }
    let addr = target_addr(f, DEFAULT_PORT)?;
    let subnqn = f
        .nqn
        .clone()
        .ok_or_else(|| anyhow!("the subsystem NQN is missing (-n NQN)"))?;
    if let Some(id) = &f.hostid {
        if parse_hostid(id).is_none() {
            bail!("--hostid {id:?} is not a UUID");
        }
    }
    let params = AttachParams {
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
        nr_io_queues: q.nr_io_queues,
        queue_size: q.queue_size,
        kato_ms: q.keep_alive_tmo.map(|s| s.saturating_mul(1000)),
    };
    let mut c = DaemonClient::connect(&ctx.socket).await?;
    let a = c.attach(name, params).await?;
    match ctx.output {
        Output::Json => print_json(&attachment_json(&a)),
        Output::Normal => {
            println!(
                "attached {} -> {} nsid {} at {}://{}:{} ({})",
                a.name,
                a.params.subnqn,
                a.params.nsid,
                a.params.transport,
                a.params.traddr,
                a.params.trsvcid,
                a.state
            );
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
        "trsvcid": a.params.trsvcid,
        "size_bytes": a.namespace.as_ref().map(|n| n.size_bytes),
        "blocks": a.namespace.as_ref().map(|n| n.blocks),
        "block_size": a.namespace.as_ref().map(|n| n.block_size),
        "model": a.controller.as_ref().map(|c| c.model.clone()),
        "serial": a.controller.as_ref().map(|c| c.serial.clone()),
        "cntlid": a.controller.as_ref().map(|c| c.cntlid),
        "state": a.state,
        "last_error": a.last_error,
        "hostnqn": a.params.hostnqn,
    })
}

async fn cmd_list(ctx: &Ctx) -> Result<()> {
    let mut c = DaemonClient::connect(&ctx.socket).await?;
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
            }
        }
    }
    Ok(())
}

fn id_ctrl_json(id: &IdentifyController) -> Value {
    json!({
        "vid": id.vid.get(),
        "ssvid": id.ssvid.get(),
        "sn": get_trimmed(&id.sn),
        "mn": get_trimmed(&id.mn),
        "fr": get_trimmed(&id.fr),
        "rab": id.rab,
        "ieee": u32::from_le_bytes([id.ieee[0], id.ieee[1], id.ieee[2], 0]),
        "cmic": id.cmic,
        "mdts": id.mdts,
        "cntlid": id.cntlid.get(),
        "ver": id.ver.get(),
        "oaes": id.oaes.get(),
        "ctratt": id.ctratt.get(),
        "cntrltype": id.cntrltype,
        "oacs": id.oacs.get(),
        "acl": id.acl,
        "aerl": id.aerl,
        "frmw": id.frmw,
        "lpa": id.lpa,
        "elpe": id.elpe,
        "npss": id.npss,
        "kas": id.kas.get(),
        "sqes": id.sqes,
        "cqes": id.cqes,
        "maxcmd": id.maxcmd.get(),
        "nn": id.nn.get(),
        "oncs": id.oncs.get(),
        "fuses": id.fuses.get(),
        "fna": id.fna,
        "vwc": id.vwc,
        "awun": id.awun.get(),
        "awupf": id.awupf.get(),
        "sgls": id.sgls.get(),
        "mnan": id.mnan.get(),
        "subnqn": get_trimmed(&id.subnqn),
        "ioccsz": id.ioccsz.get(),
        "iorcsz": id.iorcsz.get(),
        "icdoff": id.icdoff.get(),
        "fcatt": id.fcatt,
        "msdbd": id.msdbd,
        "ofcs": id.ofcs.get(),
    })
}

fn id_ns_json(id: &IdentifyNamespace) -> Value {
    let lbafs: Vec<Value> = id
        .lbaf
        .iter()
        .take(usize::from(id.nlbaf) + 1)
        .map(|f| json!({ "ms": f.ms.get(), "ds": f.lbads, "rp": f.rp }))
        .collect();
    json!({
        "nsze": id.nsze.get(),
        "ncap": id.ncap.get(),
        "nuse": id.nuse.get(),
        "nsfeat": id.nsfeat,
        "nlbaf": id.nlbaf,
        "flbas": id.flbas,
        "mc": id.mc,
        "dpc": id.dpc,
        "dps": id.dps,
        "nmic": id.nmic,
        "rescap": id.rescap,
        "dlfeat": id.dlfeat,
        "nguid": hex_id(&id.nguid),
        "eui64": hex_id(&id.eui64),
        "lbafs": lbafs,
        "block_size": id.block_size(),
    })
}

fn print_fields(v: &Value) {
    if let Value::Object(m) = v {
        for (k, val) in m {
            let s = match val {
                Value::String(s) => s.clone(),
                Value::Number(n) => {
                    if let Some(u) = n.as_u64() {
                        format!("{u:#x} ({u})")
                    } else {
                        n.to_string()
                    }
                }
                other => other.to_string(),
            };
            println!("{k:<10}: {s}");
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
    let addr = opts.addr.clone();
    let ctrl = Controller::connect(opts)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    Ok((ctrl, nsid))
}

async fn cmd_id_ctrl(ctx: &Ctx, name: Option<&str>, f: &Fabric) -> Result<()> {
    let q = QueueArgs {
        nr_io_queues: Some(0),
        ..QueueArgs::default()
    };
    let (ctrl, _) = connect_for(ctx, name, f, &q).await?;
    let id = ctrl.identify_controller().await;
    let _ = ctrl.disconnect().await;
    let id = id.context("Identify Controller")?;
    let v = id_ctrl_json(&id);
    match ctx.output {
        Output::Json => print_json(&v),
        Output::Normal => {
            println!("NVME Identify Controller:");
            print_fields(&v);
            println!("{:<10}: {}", "version", version_string(id.ver.get()));
        }
    }
    Ok(())
}

async fn cmd_id_ns(ctx: &Ctx, name: Option<&str>, f: &Fabric, nsid: Option<u32>) -> Result<()> {
    let q = QueueArgs {
        nr_io_queues: Some(0),
        ..QueueArgs::default()
    };
    let (ctrl, attached) = connect_for(ctx, name, f, &q).await?;
    let nsid = nsid.or(attached).unwrap_or(1);
    let id = ctrl.identify_namespace(nsid).await;
    let _ = ctrl.disconnect().await;
    let id = id.with_context(|| format!("Identify Namespace {nsid}"))?;
    let mut v = id_ns_json(&id);
    if let Value::Object(m) = &mut v {
        m.insert("nsid".into(), json!(nsid));
    }
    match ctx.output {
        Output::Json => print_json(&v),
        Output::Normal => {
            println!("NVME Identify Namespace {nsid}:");
            print_fields(&v);
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
            });
            if data_on_stdout {
                eprintln!("{v}");
            } else {
                print_json(&v);
            }
        }
        Output::Normal => eprintln!(
            "{op}: {blocks} blocks ({}) at block {start} of namespace {} in {:.3} s",
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
    blocks: u64,
) -> Result<()> {
    if blocks == 0 {
        bail!("--block-count must be at least 1");
    }
    if r.start_block.checked_add(blocks).is_none() {
        bail!("--start-block + --block-count overflows");
    }
    let ns = open_namespace(ctx, name, f, q, r.namespace_id).await?;
    let res = do_read(ctx, &ns, r, blocks).await;
    let _ = ns.controller().clone().disconnect().await;
    res
}

async fn do_read(ctx: &Ctx, ns: &Namespace, r: &RangeArgs, blocks: u64) -> Result<()> {
    let bs = u64::from(ns.block_size());
    let total = blocks
        .checked_mul(bs)
        .ok_or_else(|| anyhow!("--block-count is too large"))?;
    let mut out: Box<dyn Write> = if is_std(&r.data) {
        Box::new(std::io::stdout().lock())
    } else {
        let p = r.data.as_deref().unwrap_or(std::path::Path::new("-"));
        Box::new(File::create(p).with_context(|| format!("cannot create {}", p.display()))?)
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
            .with_context(|| format!("read of {n} blocks at block {lba}"))?;
        out.write_all(&buf[..len])
            .context("cannot write the output")?;
        done += n;
        progress.update(done * bs);
    }
    out.flush().context("cannot write the output")?;
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
    blocks: Option<u64>,
    durability: Durability,
) -> Result<()> {
    let ns = open_namespace(ctx, name, f, q, r.namespace_id).await?;
    let res = do_write(ctx, &ns, r, blocks, durability).await;
    let _ = ns.controller().clone().disconnect().await;
    res
}

async fn do_write(
    ctx: &Ctx,
    ns: &Namespace,
    r: &RangeArgs,
    blocks: Option<u64>,
    durability: Durability,
) -> Result<()> {
    let bs = u64::from(ns.block_size());
    let (mut input, size): (Box<dyn Read>, Option<u64>) = if is_std(&r.data) {
        (Box::new(std::io::stdin().lock()), None)
    } else {
        let p = r.data.as_deref().unwrap_or(std::path::Path::new("-"));
        let f = File::open(p).with_context(|| format!("cannot open {}", p.display()))?;
        let len = f.metadata().map(|m| m.len()).ok();
        (Box::new(f), len)
    };
    let blocks = match (blocks, size) {
        (Some(b), _) => b,
        (None, Some(s)) => {
            if s % bs != 0 {
                bail!(
                    "the input has {s} bytes, not a multiple of the block size {bs}; give --block-count"
                );
            }
            s / bs
        }
        (None, None) => bail!("--block-count is required when writing from stdin"),
    };
    if blocks == 0 {
        bail!("nothing to write (0 blocks)");
    }
    if r.start_block.checked_add(blocks).is_none() {
        bail!("--start-block + --block-count overflows");
    }
    let total = blocks
        .checked_mul(bs)
        .ok_or_else(|| anyhow!("--block-count is too large"))?;
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
                "the input ended before {total} bytes ({} blocks) were read",
                blocks
            )
        })?;
        let lba = r.start_block + done;
        let data = &buf[..len];
        let written = if durability.force_unit_access {
            ns.write_fua(lba, data).await
        } else {
            ns.write(lba, data).await
        };
        written.with_context(|| format!("write of {n} blocks at block {lba}"))?;
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
