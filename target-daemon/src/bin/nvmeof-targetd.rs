//! `nvmeof-targetd`: the nvmeof-direct NVMe-oF target daemon.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use blockdev::BackendSpec;
use clap::Parser;
use nvmeof_daemon::{LogFormat, Signal, Signals};
use nvmeof_target::config::{Config, DEFAULT_NQN, ListenAddr};
use nvmeof_target::{RunningTarget, Target};
use tracing::{info, warn};

/// Export block storage as NVMe namespaces over NVMe/TCP.
///
/// With no arguments, serves a 1 GiB memory namespace in subsystem
/// nqn.2026-11.io.nvmeof-direct:default on tcp://127.0.0.1:4420 to any host, with the discovery
/// service on the same port. Try it with the Linux host:
///   nvme discover -t tcp -a 127.0.0.1 -s 4420
///   nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2026-11.io.nvmeof-direct:default
///
/// SIGTERM or SIGINT: stop accepting, complete in-flight commands, flush, exit 0.
/// SIGHUP: logged and ignored (configuration reload is not supported yet).
/// NVMEOF_LOG: off, error, warn, info (default), debug, trace, or TARGET=LEVEL.
#[derive(Debug, Parser)]
#[command(name = "nvmeof-targetd", version, verbatim_doc_comment)]
struct Args {
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

    /// Data-plane threads (default: the config's value, else one per core).
    #[arg(long, value_name = "N")]
    reactors: Option<usize>,

    /// Busy-poll window in microseconds: while commands arrive densely, reactors poll their
    /// connections this long after each before sleeping (lower latency at the cost of CPU
    /// while busy; default: the config's value, else 50; 0 = event-driven).
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

    /// Serve Prometheus metrics at http://ADDR:PORT/metrics, e.g. 127.0.0.1:9464 (default: the
    /// config's `metrics`, else off).
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<std::net::SocketAddr>,

    /// Check the configuration, open the backends that exist, bind the listeners, then exit.
    /// Creates nothing: prints the files that starting would create.
    #[arg(long)]
    check: bool,

    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    log_format: LogFormat,
}

fn load_config(args: &Args) -> anyhow::Result<Config> {
    let mut cfg = if let Some(path) = &args.config {
        let cfg = Config::from_file(path)?;
        if let Some(w) = nvmeof_target::config::key_file_warning(path, &cfg) {
            warn!("{w}");
        }
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
    if let Some(us) = args.poll_us {
        cfg.target.poll_us = us;
    }
    let t = &mut cfg.target;
    t.handshake_timeout = args.handshake_timeout.unwrap_or(t.handshake_timeout);
    t.max_connections = args.max_connections.unwrap_or(t.max_connections);
    t.metrics = args.metrics.or(t.metrics);
    t.max_connections_per_listener = args
        .max_connections_per_listener
        .unwrap_or(t.max_connections_per_listener);
    cfg.validate()?;
    for s in &cfg.subsystems {
        if s.allow_any_host {
            warn!(subsystem = %s.nqn, "any host may connect to this subsystem");
        }
    }
    Ok(cfg)
}

async fn run(args: Args) -> anyhow::Result<()> {
    // Watched before anything else, so a signal during start-up is handled, not fatal.
    let mut signals = Signals::new().context("cannot install signal handlers")?;
    let cfg = load_config(&args)?;
    if args.check {
        let (target, listeners, report) = Target::check(&cfg)?;
        for (path, size) in &report.would_create {
            println!("would create {path} ({})", blockdev::format_size(*size));
        }
        println!(
            "configuration OK: {} subsystem(s), {} listener(s)",
            target.subsystems.len(),
            listeners.len()
        );
        return Ok(());
    }
    let (target, listeners) = Target::build(&cfg)?;
    let metrics = match cfg.target.metrics {
        Some(addr) => Some(
            nvmeof_target::metrics::bind(addr)
                .await
                .with_context(|| format!("cannot bind the metrics endpoint {addr}"))?,
        ),
        None => None,
    };
    if let Some(listener) = metrics {
        if let Ok(addr) = listener.local_addr() {
            info!(%addr, "serving metrics at http://{addr}/metrics");
        }
        tokio::spawn(nvmeof_target::metrics::serve(Arc::clone(&target), listener));
    }
    let running = RunningTarget::start(target, listeners)?;
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    info!(version = env!("CARGO_PKG_VERSION"), "nvmeof-targetd ready");

    loop {
        match signals.recv().await {
            Signal::Stop(name) => {
                info!("{name} received");
                break;
            }
            Signal::Reload => reload(),
        }
    }
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    let failures = running.shutdown().await;
    if failures > 0 {
        anyhow::bail!("{failures} namespace(s) failed to flush at shutdown");
    }
    Ok(())
}

/// Answers SIGHUP. The running target keeps its configuration: subsystems, namespaces and
/// listeners are fixed at start.
fn reload() {
    warn!("SIGHUP: configuration reload is not supported; ignoring (restart to apply changes)");
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
