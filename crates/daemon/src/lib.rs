//! What `nvmeof-targetd` and `nvmeof-initd` share as processes.
//!
//! - [`init_logging`]: logs on stderr (journald under systemd), text or JSON, filtered by the
//!   `NVMEOF_LOG` environment variable. A value that names no known level is refused instead
//!   of silently hiding every line.
//! - [`error_line`]: an error and its causes, each said once.
//! - [`Signals`]: SIGTERM and SIGINT stop a daemon; SIGHUP asks it to reload. Each daemon
//!   decides what a reload means; none of them exits on SIGHUP.
//! - [`bind_socket`] and [`lookup_group`]: a daemon's Unix socket, usable by root and by
//!   the members of one group only.
//!
//! This crate must not know about NVMe, configuration files or transports.
#![forbid(unsafe_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tokio::signal::unix::{Signal as UnixSignal, SignalKind, signal};
use tracing_subscriber::EnvFilter;

/// The environment variable holding the log filter.
pub const LOG_ENV: &str = "NVMEOF_LOG";

/// Level names accepted in [`LOG_ENV`], from quietest to noisiest.
pub const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// Log output formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// A log filter that would hide what the operator asked to see.
#[derive(Debug, thiserror::Error)]
pub enum LogFilterError {
    /// A directive names no level (`NVMEOF_LOG=verbose`).
    #[error("{LOG_ENV}={value:?}: unknown log level {level:?}; use one of {}, or TARGET=LEVEL", LEVELS.join(", "))]
    UnknownLevel {
        /// The whole value.
        value: String,
        /// The directive that is not a level.
        level: String,
    },
    /// The filter syntax is wrong.
    #[error("{LOG_ENV}={value:?}: {reason}")]
    Syntax {
        /// The whole value.
        value: String,
        /// What the filter parser said.
        reason: String,
    },
}

/// Parses a log filter: comma-separated directives, each a level (`debug`) or `TARGET=LEVEL`.
///
/// A bare word that is not a level would be read by `tracing` as a module name and would turn
/// every other line off, so it is refused.
pub fn parse_filter(value: &str) -> Result<EnvFilter, LogFilterError> {
    for directive in value.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let level = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
        if !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(level.trim())) {
            return Err(LogFilterError::UnknownLevel {
                value: value.to_string(),
                level: level.to_string(),
            });
        }
    }
    EnvFilter::builder()
        .parse(value)
        .map_err(|e| LogFilterError::Syntax {
            value: value.to_string(),
            reason: e.to_string(),
        })
}

/// Sets up logging to stderr in `format`, filtered by [`LOG_ENV`] or else by `default`
/// (a level name such as `"info"`).
pub fn init_logging(format: LogFormat, default: &str) -> Result<(), LogFilterError> {
    let value = std::env::var(LOG_ENV)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| default.to_string());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(parse_filter(&value)?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    // Only fails when a subscriber is already installed, which then keeps logging.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    Ok(())
}

/// An error and its chain of causes joined with ": ", leaving out a cause whose text the
/// message already contains (library errors often include their cause in their own message
/// and also return it as `source`), so every cause is said once.
pub fn error_line(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// What a daemon is asked to do by a signal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// Stop in an orderly way (SIGTERM, SIGINT); the name is for the log.
    Stop(&'static str),
    /// Reload the configuration (SIGHUP).
    Reload,
}

/// The signals a daemon acts on, watched from the moment this is created, so that a signal
/// that arrives during start-up is not lost (nor fatal).
pub struct Signals {
    term: UnixSignal,
    int: UnixSignal,
    hup: UnixSignal,
}

impl Signals {
    /// Installs the handlers; needs a tokio runtime with signals enabled.
    pub fn new() -> std::io::Result<Self> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Waits for the next signal. Cancel-safe: usable as a `tokio::select!` branch.
    pub async fn recv(&mut self) -> Signal {
        tokio::select! {
            _ = self.term.recv() => Signal::Stop("SIGTERM"),
            _ = self.int.recv() => Signal::Stop("SIGINT"),
            _ = self.hup.recv() => Signal::Reload,
        }
    }
}

/// Why a daemon's socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another live daemon answers on the socket.
    #[error("{} is in use: another {daemon} is running", path.display())]
    InUse {
        /// The socket.
        path: PathBuf,
        /// The daemon's name.
        daemon: String,
    },
    /// A file system step failed.
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path concerned.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The group named for the socket does not exist.
    #[error("group {0:?} not found in /etc/group")]
    NoGroup(String),
}

/// The ID of a group given by name (from `/etc/group`) or as a number.
pub fn lookup_group(name: &str) -> Result<u32, SocketError> {
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").map_err(|source| SocketError::Io {
        what: "read",
        path: PathBuf::from("/etc/group"),
        source,
    })?;
    groups
        .lines()
        .find_map(|line| {
            let mut f = line.split(':');
            (f.next() == Some(name)).then(|| f.nth(1).and_then(|g| g.parse().ok()))?
        })
        .ok_or_else(|| SocketError::NoGroup(name.to_string()))
}

/// Binds `daemon`'s Unix socket at `path`: creates its directory (mode 0755) if missing,
/// refuses to replace the socket of a live daemon, removes a stale one, and gives the socket
/// mode 0660 and the group `gid` when given, so that only root and that group's members can
/// connect. Needs a tokio runtime.
pub fn bind_socket(
    path: &Path,
    gid: Option<u32>,
    daemon: &str,
) -> Result<tokio::net::UnixListener, SocketError> {
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| SocketError::Io { what, path, source }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(io("create", dir))?;
            let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755));
        }
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(SocketError::InUse {
                path: path.to_path_buf(),
                daemon: daemon.to_string(),
            });
        }
        std::fs::remove_file(path).map_err(io("remove the stale socket", path))?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(io("listen on", path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(io("set the mode of", path))?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(io("set the group of", path))?;
    }
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot open x: {source}")]
        Open { source: std::io::Error },
        #[error("cannot start")]
        Start(#[source] std::io::Error),
    }

    #[tokio::test]
    async fn a_socket_is_private_and_a_live_one_is_not_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/d.sock");
        let l = bind_socket(&path, None, "testd").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o660);
        let e = bind_socket(&path, None, "testd").unwrap_err().to_string();
        assert!(e.contains("another testd is running"), "{e}");
        drop(l);
        // A stale socket (nobody listening) is replaced.
        bind_socket(&path, Some(0), "testd").unwrap();
        assert_eq!(lookup_group("0").unwrap(), 0);
        assert_eq!(lookup_group("root").unwrap(), 0);
        assert!(matches!(
            lookup_group("no-such-group-x"),
            Err(SocketError::NoGroup(_))
        ));
    }

    #[test]
    fn error_line_says_each_cause_once() {
        let io = || std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = Outer::Open { source: io() };
        assert_eq!(error_line(&e), format!("cannot open x: {}", io()));
        let e = Outer::Start(io());
        assert_eq!(error_line(&e), format!("cannot start: {}", io()));
    }

    #[test]
    fn levels_and_targets_are_accepted() {
        for ok in ["info", "DEBUG", "warn,nvmeof_target=trace", "off", " info "] {
            parse_filter(ok).unwrap_or_else(|e| panic!("{ok:?}: {e}"));
        }
    }

    #[test]
    fn unknown_levels_are_refused_with_the_valid_ones() {
        for bad in ["verbose", "info,loud", "nvmeof_target=chatty", "inf"] {
            let e = parse_filter(bad).unwrap_err().to_string();
            assert!(e.contains("unknown log level"), "{bad:?}: {e}");
            assert!(e.contains("off, error, warn, info, debug, trace"), "{e}");
        }
    }
}
