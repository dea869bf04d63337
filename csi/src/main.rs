//! `nvmeof-csi`: the CSI driver's binary. See the crate docs.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use nvmeof_csi::controller::{Controller, ControllerConfig};
use nvmeof_csi::node::Node;
use nvmeof_csi::{Driver, grpc};

/// Kubernetes CSI driver for nvmeof-direct.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The Unix socket to serve on (`unix:///csi/csi.sock` or a path).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Serve the Controller service with this configuration file (storage nodes, client
    /// certificate).
    #[arg(long, value_name = "FILE")]
    controller_config: Option<PathBuf>,
    /// Serve the Node service.
    #[arg(long)]
    node: bool,
    /// The host NQN this node connects with (default: /etc/nvme/hostnqn).
    #[arg(long, value_name = "NQN")]
    host_nqn: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let controller = match &args.controller_config {
        Some(path) => Some(Controller::new(ControllerConfig::load(path)?)),
        None => None,
    };
    let node = if args.node {
        let nqn = match args.host_nqn.clone() {
            Some(n) => n,
            None => std::fs::read_to_string("/etc/nvme/hostnqn")
                .context("no --host-nqn and /etc/nvme/hostnqn unreadable")?
                .trim()
                .to_string(),
        };
        anyhow::ensure!(
            nvmeof_csi::controller::is_host_nqn(&nqn),
            "host NQN {nqn:?} is not an NQN"
        );
        Some(Node::new(nqn))
    } else {
        None
    };
    anyhow::ensure!(
        controller.is_some() || node.is_some(),
        "nothing to serve: give --controller-config FILE, --node, or both"
    );
    let path = PathBuf::from(
        args.endpoint
            .strip_prefix("unix://")
            .unwrap_or(&args.endpoint),
    );
    let driver = Arc::new(Driver { controller, node });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        tracing::info!(endpoint = %path.display(), name = nvmeof_csi::DRIVER_NAME, "serving CSI");
        tokio::select! {
            r = grpc::serve(&path, driver) => r.with_context(|| format!("serving {}", path.display())),
            _ = tokio::signal::ctrl_c() => Ok(()),
        }
    })
}
