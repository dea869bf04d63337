//! Reactors: one OS thread per core, each running a current-thread tokio runtime that owns the
//! connections handed to it. Connections never migrate, so per-connection state needs no locks.

use std::sync::Arc;

use tokio::sync::mpsc;
use tracing::{error, warn};

use crate::target::Target;

/// Runs reactor `index` until its connection channel closes and its connections have ended.
pub fn run(
    index: usize,
    target: Arc<Target>,
    mut rx: mpsc::UnboundedReceiver<std::net::TcpStream>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(reactor = index, error = %e, "cannot start reactor runtime");
            return;
        }
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        while let Some(stream) = rx.recv().await {
            let stream = match tokio::net::TcpStream::from_std(stream) {
                Ok(s) => s,
                Err(e) => {
                    warn!(reactor = index, error = %e, "cannot register connection");
                    continue;
                }
            };
            let t = Arc::clone(&target);
            tokio::task::spawn_local(crate::tcp::serve(t, stream));
        }
    });
    // Let every connection finish its in-flight commands and close.
    rt.block_on(local);
}
