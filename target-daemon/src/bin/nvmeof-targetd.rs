//! `nvmeof-targetd`: the nvmeof-direct NVMe-oF target daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use blockdev::BackendSpec;
use clap::Parser;
use nvmeof_daemon::{LogFormat, Signal, Signals};
use nvmeof_target::config::{
    Config, DEFAULT_CONTROL_SOCKET, DEFAULT_NQN, ListenAddr, TargetSettings,
};
use nvmeof_target::control::{Request, Response};
use nvmeof_target::reconfigure::{ConfigFiles, Registry};
use nvmeof_target::{RunningTarget, Target};
use serde_json::Value;
use tracing::{error, info, warn};

/// Export block storage as NVMe namespaces over NVMe/TCP.
///
/// With no arguments, serves a 1 GiB memory namespace in subsystem
/// nqn.2026-11.io.nvmeof-direct:default on tcp://127.0.0.1:4420 to any host, with the discovery
/// service on the same port. Try it with the Linux host:
///   nvme discover -t tcp -a 127.0.0.1 -s 4420
///   nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2026-11.io.nvmeof-direct:default
///
/// Change it while it runs with `nvmeof-targetd ctl` (see `nvmeof-targetd ctl --help`):
///   nvmeof-targetd ctl add-namespace --subsystem NQN --backend file:/srv/ns2.img,size=10G
///
/// SIGTERM or SIGINT: stop accepting, complete in-flight commands, flush, exit 0.
/// SIGHUP: reload the --config file and apply what changed (nothing if it is invalid).
/// Changes made with `ctl` are written back to the --config file (the previous one kept as
/// FILE.bak), so a restart runs what ran.
/// NVMEOF_LOG: off, error, warn, info (default), debug, trace, or TARGET=LEVEL.
#[derive(Debug, Parser)]
#[command(
    name = "nvmeof-targetd",
    version,
    verbatim_doc_comment,
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,

    /// TOML configuration file (subsystems, namespaces, listeners, allowed hosts, limits).
    /// See deploy/nvmeof-targetd.toml for an annotated example.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["listen", "subsystem", "namespace", "allow_any_host", "host"])]
    config: Option<PathBuf>,

    /// Listen on this address (repeatable), e.g. tcp://0.0.0.0:4420.
    #[arg(long, value_name = "tcp://ADDR:PORT")]
    listen: Vec<ListenAddr>,

    /// NQN of the subsystem to export (-n as in nvme-cli's --nqn).
    #[arg(short = 'n', long, value_name = "NQN")]
    subsystem: Option<String>,

    /// A namespace (repeatable, NSIDs from 1 in order): mem:SIZE, null:SIZE,
    /// file:PATH[,size=SIZE], bdev:PATH or pcie:DOMAIN:BUS:DEV.FN[,nsid=N] (an NVMe controller
    /// bound to vfio-pci). SIZE takes K, M, G, T suffixes (powers of 1024).
    #[arg(long, value_name = "SPEC")]
    namespace: Vec<BackendSpec>,

    /// Let any host connect (the default when no --host is given).
    #[arg(long)]
    allow_any_host: bool,

    /// Allow this host NQN (repeatable); other hosts are refused with Connect Invalid Host.
    #[arg(long, value_name = "NQN")]
    host: Vec<String>,

    /// Data-plane threads (default: the config's value, else one per CPU of --cpus, else
    /// one per core).
    #[arg(long, value_name = "N")]
    reactors: Option<usize>,

    /// Pin reactor N to the Nth of these CPUs, e.g. 0-7 or 0,2,4-6 (wrapping around when
    /// there are more reactors than CPUs; default: the config's value, else unpinned).
    #[arg(long, value_name = "LIST")]
    cpus: Option<String>,

    /// Busy-poll window in microseconds: while commands arrive densely, reactors poll their
    /// connections this long after each before sleeping, four times as long after the last
    /// (lower latency at the cost of CPU while busy; default: the config's value, else 50;
    /// 0 = event-driven).
    #[arg(long, value_name = "US")]
    poll_us: Option<u32>,

    /// Close connections that have not finished the ICReq and the Fabrics Connect within
    /// this time, e.g. 5s or 500ms (default: the config's value, else 5s).
    #[arg(long, value_name = "DURATION", value_parser = nvmeof_target::config::parse_duration)]
    handshake_timeout: Option<Duration>,

    /// Most connections open on the whole target; more are closed as soon as accepted
    /// (default: the config's value, else 16384).
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,

    /// Most connections open on one listener; more are closed as soon as accepted
    /// (default: the config's value, else 4096).
    #[arg(long, value_name = "N")]
    max_connections_per_listener: Option<usize>,

    /// The memory all connections together may hold in send backlogs, receive buffers and
    /// data buffers, e.g. 1G or 512M (default: the config's memory_budget, else 1G; at least
    /// 16M). A connection over it stops reading until others give memory back.
    #[arg(long, value_name = "SIZE", value_parser = parse_budget)]
    memory_budget: Option<u64>,

    /// Serve Prometheus metrics at http://ADDR:PORT/metrics, e.g. 127.0.0.1:9464 (default: the
    /// config's `metrics`, else off).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<std::net::SocketAddr>,

    /// Check the configuration, open the backends that exist, bind the listeners, then exit.
    /// Creates nothing: prints the files that starting would create.
    #[arg(long)]
    check: bool,

    /// The control socket (default: the config's control_socket, else
    /// /run/nvmeof/targetd.sock; the default is skipped with a warning when another daemon
    /// holds it or it cannot be created).
    #[arg(long, value_name = "PATH")]
    control_socket: Option<PathBuf>,

    /// Group (name or ID) allowed to use the control socket besides root (default: the
    /// config's control_group).
    #[arg(long, value_name = "GROUP")]
    control_group: Option<String>,

    /// The directory `ctl save` may write to (default: the config's save_dir, else the
    /// --config file's directory; without either, saves are refused).
    #[arg(long, value_name = "DIR")]
    save_dir: Option<PathBuf>,

    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Inspect or change a running nvmeof-targetd through its control socket. Every change is
    /// checked as a whole before anything changes; hosts are told (new namespaces appear on
    /// them without a reconnect).
    Ctl(CtlArgs),
}

#[derive(Debug, clap::Args)]
struct CtlArgs {
    /// The daemon's control socket.
    #[arg(long, env = "NVMEOF_TARGETD_SOCKET", value_name = "PATH", default_value = DEFAULT_CONTROL_SOCKET)]
    socket: PathBuf,
    /// Use the target's remote control API at HOST:PORT (mutual TLS) instead of the socket.
    #[arg(
        long,
        env = "NVMEOF_TARGETD_REMOTE",
        value_name = "HOST:PORT",
        requires = "ca"
    )]
    remote: Option<String>,
    /// With --remote: this client's certificate (PEM).
    #[arg(
        long,
        env = "NVMEOF_TARGETD_CERT",
        value_name = "FILE",
        requires = "remote",
        requires = "key"
    )]
    cert: Option<PathBuf>,
    /// With --remote: this client's private key (PEM).
    #[arg(
        long,
        env = "NVMEOF_TARGETD_KEY",
        value_name = "FILE",
        requires = "cert"
    )]
    key: Option<PathBuf>,
    /// With --remote: the CA certificates (PEM) the target's certificate must be signed by.
    #[arg(
        long,
        env = "NVMEOF_TARGETD_CA",
        value_name = "FILE",
        requires = "remote"
    )]
    ca: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "normal")]
    output: Output,
    #[command(subcommand)]
    request: Request,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    /// Lines for people.
    Normal,
    /// The daemon's JSON answer.
    Json,
}

/// The configuration to run, and the `[target]` settings of the --config file (before flags
/// override them), which are written back with every live change.
fn load_config(args: &Args) -> anyhow::Result<(Config, Option<TargetSettings>)> {
    let mut file_settings = None;
    let mut cfg = if let Some(path) = &args.config {
        let cfg = Config::from_file(path)?;
        if let Some(w) = nvmeof_target::config::key_file_warning(path, &cfg) {
            warn!("{w}");
        }
        file_settings = Some(cfg.target.clone());
        cfg
    } else if args.listen.is_empty()
        && args.subsystem.is_none()
        && args.namespace.is_empty()
        && args.host.is_empty()
        && !args.allow_any_host
    {
        info!("no configuration given: serving the embedded default");
        Config::embedded_default()
    } else {
        let listen = if args.listen.is_empty() {
            vec![nvmeof_target::config::DEFAULT_LISTEN.parse()?]
        } else {
            args.listen.clone()
        };
        let namespaces = if args.namespace.is_empty() {
            vec![nvmeof_target::config::DEFAULT_NAMESPACE.parse()?]
        } else {
            args.namespace.clone()
        };
        let nqn = args.subsystem.as_deref().unwrap_or(DEFAULT_NQN);
        let any = args.allow_any_host || args.host.is_empty();
        Config::quick(&listen, nqn, &namespaces, any, &args.host)?
    };
    if let Some(n) = args.reactors {
        cfg.target.reactors = n;
    }
    if let Some(list) = &args.cpus {
        cfg.target.cpus = Some(list.clone());
    }
    if let Some(us) = args.poll_us {
        cfg.target.poll_us = us;
    }
    let t = &mut cfg.target;
    t.handshake_timeout = args.handshake_timeout.unwrap_or(t.handshake_timeout);
    t.max_connections = args.max_connections.unwrap_or(t.max_connections);
    t.metrics = args.metrics.or(t.metrics);
    t.memory_budget = args.memory_budget.unwrap_or(t.memory_budget);
    t.max_connections_per_listener = args
        .max_connections_per_listener
        .unwrap_or(t.max_connections_per_listener);
    if let Some(dir) = &args.save_dir {
        t.save_dir = Some(dir.clone());
    }
    cfg.validate()?;
    for s in &cfg.subsystems {
        if s.allow_any_host {
            warn!(subsystem = %s.nqn, "any host may connect to this subsystem");
        }
        if s.allow_any_host && !s.hosts.is_empty() {
            warn!(
                subsystem = %s.nqn,
                "allow_any_host = true: the hosts list has no effect (any host may connect); \
                 set allow_any_host = false to admit only the listed hosts"
            );
        }
    }
    if cfg.subsystems.is_empty() {
        warn!(
            "no subsystem configured: hosts can only discover that there is nothing to connect \
             to (add one with [[subsystem]] or ctl add-subsystem)"
        );
    }
    Ok((cfg, file_settings))
}

/// Where the running configuration goes: back into the --config file after every live
/// change, and `ctl save` into save_dir (default: the --config file's directory).
fn config_files(args: &Args, cfg: &Config, file_settings: Option<TargetSettings>) -> ConfigFiles {
    let config = args
        .config
        .as_ref()
        .and_then(|p| std::path::absolute(p).ok());
    let save_dir = cfg.target.save_dir.clone().or_else(|| {
        config
            .as_ref()
            .and_then(|p| p.parent().map(std::path::Path::to_path_buf))
    });
    ConfigFiles {
        persist: config.zip(file_settings),
        save_dir,
    }
}

async fn run(mut args: Args) -> anyhow::Result<()> {
    if let Some(Command::Ctl(ctl)) = args.command.take() {
        return run_ctl(ctl).await;
    }
    let args = Arc::new(args);
    // Watched before anything else, so a signal during start-up is handled, not fatal.
    let mut signals = Signals::new().context("cannot install signal handlers")?;
    let (cfg, file_settings) = load_config(&args)?;
    if args.check {
        let (target, report) = Target::check(&cfg)?;
        let listeners = nvmeof_target::launcher::bind(&cfg)?;
        if let Some(addr) = cfg.target.metrics {
            // Bound as starting would, then let go.
            std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot bind the metrics endpoint {addr}"))?;
        }
        check_control_socket(&args, &cfg)?;
        if let Some(remote) = &cfg.target.remote_control {
            nvmeof_target::remote::server_context(remote)?;
        }
        for (path, size) in &report.would_create {
            println!("would create {path} ({})", blockdev::format_size(*size));
        }
        println!(
            "configuration OK: {} subsystem(s), {} listener(s)",
            target.subsystems().len(),
            listeners.len()
        );
        return Ok(());
    }
    raise_open_files_limit(cfg.target.max_connections);
    let target = Target::build(&cfg)?;
    let listeners = nvmeof_target::launcher::bind(&cfg)?;
    let metrics = match cfg.target.metrics {
        Some(addr) => Some(
            nvmeof_target::exporter::bind(addr)
                .await
                .with_context(|| format!("cannot bind the metrics endpoint {addr}"))?,
        ),
        None => None,
    };
    if let Some(listener) = metrics {
        if let Ok(addr) = listener.local_addr() {
            info!(%addr, "serving metrics at http://{addr}/metrics");
        }
        tokio::spawn(nvmeof_target::exporter::serve(
            Arc::clone(&target),
            listener,
        ));
    }
    let running = RunningTarget::start(target, listeners)?;
    let files = config_files(&args, &cfg, file_settings);
    let registry = Arc::new(Registry::new(running, cfg.clone()).with_files(files));
    let socket = control_socket(&args, &cfg, &registry)?;
    if let Some(remote) = &cfg.target.remote_control {
        let server = nvmeof_target::remote::Server::bind(remote).await?;
        if let Some(addr) = server.local_addr() {
            info!(%addr, "remote control API ready (mutual TLS)");
        }
        tokio::spawn(server.serve(
            Arc::clone(&registry),
            nvmeof_target::control::ClientLimits::default(),
        ));
    }
    let mdns = match cfg.discovery.mdns {
        true => nvmeof_target::advertise::Advertiser::start(Arc::clone(registry.target())).await,
        false => None,
    };
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    info!(version = env!("CARGO_PKG_VERSION"), "nvmeof-targetd ready");

    loop {
        match signals.recv().await {
            Signal::Stop(name) => {
                info!("{name} received");
                break;
            }
            Signal::Reload => {
                let (args, registry) = (Arc::clone(&args), Arc::clone(&registry));
                let _ = tokio::task::spawn_blocking(move || reload(&args, &registry)).await;
            }
        }
    }
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    if let Some(m) = mdns {
        m.stop().await;
    }
    let failures = registry.running().shutdown().await;
    if let Some(path) = socket {
        let _ = std::fs::remove_file(path);
    }
    if failures > 0 {
        anyhow::bail!("{failures} namespace(s) failed to flush at shutdown");
    }
    Ok(())
}

/// `--check` of the control socket: the one asked for must not be held by a running daemon
/// (for the default one, starting would only warn, and so does this).
fn check_control_socket(args: &Args, cfg: &Config) -> anyhow::Result<()> {
    let chosen = args
        .control_socket
        .clone()
        .or_else(|| cfg.target.control_socket.clone());
    let path = chosen
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTROL_SOCKET));
    if std::os::unix::net::UnixStream::connect(&path).is_err() {
        return Ok(());
    }
    let held = format!(
        "control socket {}: another nvmeof-targetd is running and holds it",
        path.display()
    );
    if chosen.is_some() {
        anyhow::bail!("{held} (stop it, or give another --control-socket)");
    }
    eprintln!("warning: {held}: this daemon would run without a control socket");
    Ok(())
}

/// Binds the control socket and serves it. Returns its path, to remove at exit; None when
/// the default socket cannot be used (a warning says why).
fn control_socket(
    args: &Args,
    cfg: &Config,
    registry: &Arc<Registry>,
) -> anyhow::Result<Option<PathBuf>> {
    let chosen = args
        .control_socket
        .clone()
        .or_else(|| cfg.target.control_socket.clone());
    let path = chosen
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTROL_SOCKET));
    let group = args
        .control_group
        .as_ref()
        .or(cfg.target.control_group.as_ref());
    let gid = group.map(|g| nvmeof_daemon::lookup_group(g)).transpose()?;
    let listener = match nvmeof_daemon::bind_socket(&path, gid, "nvmeof-targetd") {
        Ok(l) => l,
        // The default is best effort (another daemon holds it, or /run is not writable for
        // this user); a socket asked for must work.
        Err(e) if chosen.is_none() => {
            warn!("{e}: no control socket for this daemon (give --control-socket PATH)");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    info!(socket = %path.display(), "control socket ready");
    tokio::spawn(nvmeof_target::control::serve(
        listener,
        Arc::clone(registry),
        nvmeof_target::control::ClientLimits::default(),
    ));
    Ok(Some(path))
}

/// Answers SIGHUP: reads the configuration file again and applies what changed, all or
/// nothing.
fn reload(args: &Args, registry: &Registry) {
    let Some(path) = &args.config else {
        warn!("SIGHUP: started without --config; nothing to reload");
        return;
    };
    info!(path = %path.display(), "SIGHUP: reloading the configuration");
    let result = load_config(args).and_then(|(cfg, _)| Ok(registry.apply(cfg)?));
    match result {
        Ok(changes) if changes.is_empty() => info!("reload: nothing changed"),
        Ok(changes) => info!(changes = changes.len(), "reload applied"),
        Err(e) => error!(
            "reload refused, nothing changed: {}",
            nvmeof_daemon::error_line(e.as_ref())
        ),
    }
}

/// `nvmeof-targetd ctl`: one request, its answer on stdout; exit status 1 when refused.
async fn run_ctl(ctl: CtlArgs) -> anyhow::Result<()> {
    let mut request = ctl.request;
    match &mut request {
        Request::Save { path } => {
            *path = std::path::absolute(&*path)
                .with_context(|| format!("{}: cannot make the path absolute", path.display()))?;
        }
        Request::AddHost {
            dhchap_key,
            dhchap_key_file,
            dhchap_ctrl_key,
            dhchap_ctrl_key_file,
            tls_psk,
            tls_psk_file,
            ..
        } => {
            let files = [dhchap_key_file, dhchap_ctrl_key_file, tls_psk_file];
            if files
                .iter()
                .filter(|f| f.as_deref() == Some("-".as_ref()))
                .count()
                > 1
            {
                anyhow::bail!("only one key can come from standard input (-)");
            }
            for (key, file) in [dhchap_key, dhchap_ctrl_key, tls_psk]
                .into_iter()
                .zip(files)
            {
                if let Some(f) = file.take() {
                    *key = Some(read_key_file(&f)?);
                }
            }
        }
        _ => {}
    }
    let resp = match (&ctl.remote, &ctl.ca) {
        (Some(addr), Some(ca)) => {
            let files = nvmeof_target::remote::ClientFiles {
                cert_key: ctl.cert.clone().zip(ctl.key.clone()),
                ca: ca.clone(),
            };
            nvmeof_target::remote::request(addr, &files, &request).await?
        }
        _ => nvmeof_target::control::request(&ctl.socket, &request).await?,
    };
    match ctl.output {
        Output::Json => println!("{}", serde_json::to_string_pretty(&resp)?),
        Output::Normal => print_normal(&resp),
    }
    match resp.error {
        Some(e) if ctl.output == Output::Normal => anyhow::bail!("{e}"),
        Some(_) => Err(anyhow::anyhow!("request refused")),
        None => Ok(()),
    }
}

/// A key from a file (`-`: standard input): its first line, without surrounding blanks.
fn read_key_file(path: &std::path::Path) -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut text = String::new();
    if path.as_os_str() == "-" {
        std::io::stdin()
            .take(64 * 1024)
            .read_to_string(&mut text)
            .context("cannot read a key from standard input")?;
    } else {
        std::fs::File::open(path)
            .and_then(|f| f.take(64 * 1024).read_to_string(&mut text))
            .with_context(|| format!("cannot read a key from {}", path.display()))?;
    }
    match text.lines().next().map(str::trim) {
        Some(k) if !k.is_empty() => Ok(k.to_string()),
        _ => anyhow::bail!("{}: no key in it", path.display()),
    }
}

fn print_normal(resp: &Response) {
    if let Some(changes) = &resp.changes {
        if changes.is_empty() {
            println!("nothing changed");
        }
        for c in changes {
            println!("{c}");
        }
    }
    let Some(status) = &resp.status else { return };
    let list = |v: &Value| -> String {
        let items: Vec<&str> = v
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if items.is_empty() {
            "none".into()
        } else {
            items.join(", ")
        }
    };
    println!("listeners: {}", list(&status["listeners"]));
    println!(
        "discovery listeners: {}",
        list(&status["discovery_listeners"])
    );
    if status["referrals"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
    {
        println!("referrals: {}", list(&status["referrals"]));
    }
    for a in status["ana"].as_array().into_iter().flatten() {
        println!(
            "ANA group {} on {}: {}",
            a["group"],
            a["listener"].as_str().unwrap_or("?"),
            a["state"].as_str().unwrap_or("?")
        );
    }
    for s in status["subsystems"].as_array().into_iter().flatten() {
        println!(
            "subsystem {} (serial {}, model {})",
            s["nqn"].as_str().unwrap_or("?"),
            s["serial"].as_str().unwrap_or("?"),
            s["model"].as_str().unwrap_or("?")
        );
        let mut hosts: Vec<String> = Vec::new();
        if s["allow_any_host"].as_bool() == Some(true) {
            hosts.push("any".into());
        }
        let names = |k: &str| -> Vec<String> {
            s[k].as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default()
        };
        hosts.extend(names("hosts"));
        // Hosts with keys, named with the kind of key only (never the key).
        let (dhchap, tls) = (names("dhchap_hosts"), names("tls_hosts"));
        let mut keyed: Vec<&String> = dhchap.iter().chain(&tls).collect();
        keyed.sort();
        keyed.dedup();
        for h in keyed {
            let kinds: Vec<&str> = [(&dhchap, "DH-HMAC-CHAP"), (&tls, "TLS PSK")]
                .iter()
                .filter(|(l, _)| l.contains(h))
                .map(|(_, k)| *k)
                .collect();
            hosts.push(format!("{h} ({})", kinds.join(", ")));
        }
        if hosts.is_empty() {
            hosts.push("none".into());
        }
        println!("  hosts: {}", hosts.join(", "));
        for ns in s["namespaces"].as_array().into_iter().flatten() {
            let seen_by = match list(&ns["hosts"]).as_str() {
                "none" => String::new(),
                hosts => format!(", seen by {hosts} only"),
            };
            println!(
                "  namespace {}: {} ({} blocks of {} bytes, {}, ANA group {}{seen_by})",
                ns["nsid"],
                ns["backend"].as_str().unwrap_or("?"),
                ns["blocks"],
                ns["block_size"],
                blockdev::format_size(ns["size"].as_u64().unwrap_or(0)),
                ns["ana_group"]
            );
        }
        for c in s["controllers"].as_array().into_iter().flatten() {
            println!(
                "  controller {}: {} from {}, {} I/O queues, keep alive {} ms",
                c["cntlid"],
                c["host"].as_str().unwrap_or("?"),
                c["peer"].as_str().unwrap_or("?"),
                c["io_queues"],
                c["keep_alive_ms"]
            );
        }
    }
    if let Some(n) = status["connections"].as_u64() {
        println!("connections: {n}");
    }
    let m = &status["metrics"];
    if let (Some(used), Some(budget)) = (
        m["memory_in_use_bytes"].as_u64(),
        m["memory_budget_bytes"].as_u64(),
    ) {
        println!(
            "connection memory: {} of {}",
            blockdev::format_size(used),
            blockdev::format_size(budget)
        );
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = nvmeof_daemon::init_logging(args.log_format, "info") {
        eprintln!("nvmeof-targetd: {e}");
        return ExitCode::FAILURE;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("nvmeof-control")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nvmeof-targetd: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line on stderr, which journald records once.
            eprintln!("nvmeof-targetd: {}", nvmeof_daemon::error_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Parses `--memory-budget` (K, M, G, T suffixes, powers of 1024).
fn parse_budget(s: &str) -> Result<u64, String> {
    blockdev::parse_size(s).map_err(|e| e.to_string())
}

/// Raises the soft limit on open files to the hard limit (each connection is one), and
/// says so in the log when even that is below `max_connections`.
fn raise_open_files_limit(max_connections: usize) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current < lim.maximum {
        let old = lim.current;
        lim.current = lim.maximum;
        match setrlimit(Resource::Nofile, lim) {
            Ok(()) => {
                let show = |n: Option<u64>| n.map_or("unlimited".to_string(), |n| n.to_string());
                info!(
                    from = %show(old),
                    to = %show(lim.maximum),
                    "raised the open files limit to the hard limit"
                );
            }
            Err(e) => {
                warn!(error = %e, "cannot raise the open files limit");
                lim.current = old;
            }
        }
    }
    // A few files besides the connections: listeners, backends, sockets, the log.
    let needed = max_connections as u64 + 64;
    if let Some(limit) = lim.current.filter(|&n| n < needed) {
        warn!(
            limit,
            max_connections,
            "the open files limit is below max_connections: connections past it are refused"
        );
    }
}
