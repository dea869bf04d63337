//! Errors of the initiator.

use std::sync::Arc;
use std::time::Duration;

use nvme_spec::status::{generic, sct};
use nvme_spec::{Cqe, Status};
use nvmf_tcp::ProtocolError;

/// Everything that can go wrong talking to an NVMe-oF target.
///
/// Errors are cheap to clone (sources are reference counted) because one connection failure
/// is reported to every command that was waiting on it.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The controller completed a command with an error status.
    #[error(
        "{command} failed: {name} (sct {:#x}, sc {:#04x}{})",
        status.sct,
        status.sc,
        if status.dnr { ", dnr" } else { "" }
    )]
    Status {
        /// The command (for example "Read", "Identify", "Connect").
        command: &'static str,
        /// The completion status, with its Do Not Retry bit.
        status: Status,
        /// The specification's name of the status.
        name: &'static str,
    },
    /// A wait took longer than its configured timeout.
    #[error("timed out after {} ms waiting for {what}", after.as_millis())]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// The timeout that expired.
        after: Duration,
    },
    /// The TCP connection could not be opened.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// Target address.
        addr: String,
        /// The socket error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The connection broke (closed by the peer, socket error).
    #[error("connection to {addr} lost: {reason}")]
    ConnectionLost {
        /// Target address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The target violated the NVMe/TCP protocol; the connection was terminated.
    #[error("NVMe/TCP protocol error from {addr}: {source}")]
    Protocol {
        /// Target address.
        addr: String,
        /// What the engine found.
        #[source]
        source: ProtocolError,
    },
    /// NVMe/RDMA was asked for but this host cannot do RDMA (rdma-core is not installed, or
    /// there is no RDMA device).
    #[error("NVMe/RDMA is not available: {0}")]
    RdmaUnavailable(String),
    /// An RDMA connection could not be set up or failed (address resolution, RDMA-CM,
    /// memory registration, a work request completed with an error).
    #[error("NVMe/RDMA connection to {addr}: {reason}")]
    Rdma {
        /// Target address.
        addr: String,
        /// What happened.
        reason: String,
    },
    /// The target terminated the connection with a C2HTermReq.
    #[error("target {addr} terminated the connection (C2HTermReq, FES {fes:#x}: {}, FEI {fei:#x})", fes_name(*fes))]
    TermReq {
        /// Target address.
        addr: String,
        /// Fatal error status.
        fes: u16,
        /// Fatal error information.
        fei: u32,
    },
    /// A command that changes data was in flight when the connection was lost. It may or may
    /// not have been applied by the target, so it was not retried (see
    /// [`ConnectOptions::retry_writes`](crate::ConnectOptions::retry_writes)).
    #[error(
        "{command} was in flight when the connection to {addr} was lost ({reason}); it may or may not have been applied and was not retried"
    )]
    Interrupted {
        /// The command.
        command: &'static str,
        /// Target address.
        addr: String,
        /// Why the connection was lost.
        reason: String,
    },
    /// The controller could not be recovered after a connection loss and gave up.
    #[error("controller at {addr} failed: {reason}")]
    ControllerFailed {
        /// Target address.
        addr: String,
        /// The last error seen while reconnecting.
        reason: String,
    },
    /// In-band authentication (DH-HMAC-CHAP) of a queue failed, or the controller requires
    /// it and no secret was given.
    #[error("authentication of queue {qid} failed: {reason}")]
    Auth {
        /// The queue (0: admin).
        qid: u16,
        /// Why, as one line (never key material).
        reason: String,
    },
    /// The TLS handshake with the target failed (a PSK the target does not know or does
    /// not match, a listener without TLS), or the PSK cannot be used.
    #[error("TLS with {addr} failed: {reason}")]
    Tls {
        /// Target address.
        addr: String,
        /// Why, as one line (never key material).
        reason: String,
    },
    /// The controller (or this queue) was closed by the host.
    #[error("the controller is closed")]
    Closed,
    /// The target answered in a way this host does not accept (for example a controller ID
    /// that differs from the Connect answer, or a subsystem NQN that was not asked for).
    #[error("target refused: {0}")]
    Refused(String),
    /// A request from the caller that cannot be carried out.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A caller buffer (a [`ReadDest`](crate::ReadDest) or
    /// [`WriteSource`](crate::WriteSource)) reported an error.
    #[error("buffer error: {0}")]
    Buffer(String),
    /// The host identity (host NQN and host ID) could not be read or stored.
    #[error("host identity: {0}")]
    Identity(String),
    /// The nvmeof-initd daemon could not be reached or refused a request.
    #[error("nvmeof-initd: {0}")]
    Daemon(String),
    /// nvmeof-initd carried out a request and it failed at the target (for example an
    /// attach whose connection or authentication failed): the message, and which kind of
    /// failure it was, as the daemon classified it.
    #[error("{message}")]
    ViaDaemon {
        /// The kind of failure (never [`ErrorClass::Daemon`]).
        class: ErrorClass,
        /// The daemon's message.
        message: String,
    },
    /// A registered buffer is still the target of commands in flight (of a read or write whose
    /// future was dropped): its bytes are not readable until they end.
    #[error("the registered buffer is still used by commands in flight")]
    BufferBusy,
    /// A [`QueuePair`](crate::QueuePair) has as many commands in flight as it has entries:
    /// reap completions before submitting more.
    #[error("the queue pair is full ({depth} commands in flight)")]
    QueueFull {
        /// Commands the queue pair holds at most.
        depth: usize,
    },
    /// The connection cannot do what was asked (for example registering GPU memory on an
    /// NVMe/TCP controller, or on a host whose RDMA device refuses it).
    #[error("not supported: {0}")]
    Unsupported(String),
    /// No path of a multipath attachment can carry the command (all lost, inaccessible or
    /// changing for longer than the wait allows, or in persistent loss).
    #[error("no usable path: {0}")]
    NoPath(String),
    /// A GPU call failed (setting up the push path of GPU request rings).
    #[error("GPU: {0}")]
    Gpu(String),
}

/// Kinds of failure, as a command-line tool tells them apart (by exit status).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The request itself is wrong (an argument, a range).
    Usage,
    /// The target cannot be reached, the connection was lost, or the connection was refused
    /// (authentication, TLS, a controller that gave up).
    Target,
    /// The target answered with an NVMe error status.
    Status,
    /// nvmeof-initd cannot be reached or refused the request.
    Daemon,
    /// Anything else.
    Other,
}

impl Error {
    /// Which kind of failure this is.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::InvalidArgument(_) => ErrorClass::Usage,
            Error::Status { .. } => ErrorClass::Status,
            Error::Daemon(_) => ErrorClass::Daemon,
            Error::ViaDaemon { class, .. } => *class,
            Error::ControllerFailed { .. }
            | Error::Refused(_)
            | Error::RdmaUnavailable(_)
            | Error::Auth { .. }
            | Error::Tls { .. }
            | Error::NoPath(_) => ErrorClass::Target,
            e if e.is_transport() => ErrorClass::Target,
            _ => ErrorClass::Other,
        }
    }

    /// The NVMe status for a command that completed with an error status.
    pub fn status(&self) -> Option<Status> {
        match self {
            Error::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// True for a timeout.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// True when the failure came from the connection rather than from the command itself.
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            Error::Connect { .. }
                | Error::ConnectionLost { .. }
                | Error::Protocol { .. }
                | Error::TermReq { .. }
                | Error::Rdma { .. }
                | Error::Interrupted { .. }
                | Error::Timeout { .. }
        )
    }

    pub(crate) fn status_of(command: &'static str, status: Status) -> Self {
        Error::Status {
            command,
            status,
            name: status_name(command, status),
        }
    }

    pub(crate) fn connect(addr: &str, e: std::io::Error) -> Self {
        Error::Connect {
            addr: addr.to_string(),
            source: Arc::new(e),
        }
    }

    pub(crate) fn lost(addr: &str, reason: impl Into<String>) -> Self {
        Error::ConnectionLost {
            addr: addr.to_string(),
            reason: reason.into(),
        }
    }

    pub(crate) fn timeout(what: &'static str, after: Duration) -> Self {
        Error::Timeout { what, after }
    }
}

/// The name of a status returned for `command`. Command specific codes (SCT 1) from 80h up
/// mean different things for Fabrics Connect and for NVM I/O commands (NVM Command Set 1.0,
/// Figure 17); the generic table only knows the Connect meanings.
pub fn status_name(command: &str, status: Status) -> &'static str {
    let io = matches!(
        command,
        "Read" | "Write" | "Flush" | "Write Zeroes" | "Dataset Management" | "Compare"
    );
    if io && status.sct == 1 {
        match status.sc {
            0x80 => return "Conflicting Attributes",
            0x81 => return "Invalid Protection Information",
            0x82 => return "Attempted Write to Read Only Range",
            0x83 => return "Command Size Limit Exceeded (ONCS Not Supported)",
            _ => {}
        }
    }
    status.name()
}

/// For a Connect that the target refused because of who is asking or what for, a sentence
/// that names the host NQN and the subsystem and says what to do; `None` for other errors.
pub fn connect_hint(e: &Error, hostnqn: &str, subnqn: &str) -> Option<String> {
    use nvme_spec::status::specific as fc;
    let Error::Status {
        command: "Connect",
        status,
        ..
    } = e
    else {
        return None;
    };
    if status.sct != sct::COMMAND_SPECIFIC {
        return None;
    }
    match status.sc {
        fc::CONNECT_INVALID_HOST => Some(format!(
            "the target does not allow host {hostnqn} on subsystem {subnqn} (its administrator \
             must add this host NQN to the subsystem)"
        )),
        fc::CONNECT_INVALID_PARAMETERS => Some(format!(
            "subsystem {subnqn} is not on the target, or this host may not use it (`nvmeof \
             discover` lists the subsystems host {hostnqn} may connect to)"
        )),
        _ => None,
    }
}

/// Name of an NVMe/TCP Fatal Error Status value (NVMe/TCP 1.0, Figure 29).
pub fn fes_name(fes: u16) -> &'static str {
    match fes {
        0x01 => "Invalid PDU Header Field",
        0x02 => "PDU Sequence Error",
        0x03 => "Header Digest Error",
        0x04 => "Data Transfer Out of Range",
        0x05 => "Data Transfer Limit Exceeded",
        0x06 => "Unsupported Parameter",
        _ => "reserved value",
    }
}

/// The name of the command an SQE carries, for error messages.
pub(crate) fn command_name(admin: bool, opcode: u8, fctype: u8) -> &'static str {
    use nvme_spec::opcode::{FABRICS, admin as a, fctype as f, io};
    if opcode == FABRICS {
        return match fctype {
            f::CONNECT => "Connect",
            f::PROPERTY_GET => "Property Get",
            f::PROPERTY_SET => "Property Set",
            f::DISCONNECT => "Disconnect",
            f::AUTH_SEND => "Authentication Send",
            f::AUTH_RECEIVE => "Authentication Receive",
            _ => "Fabrics command",
        };
    }
    if admin {
        match opcode {
            a::GET_LOG_PAGE => "Get Log Page",
            a::IDENTIFY => "Identify",
            a::ABORT => "Abort",
            a::SET_FEATURES => "Set Features",
            a::GET_FEATURES => "Get Features",
            a::ASYNC_EVENT_REQUEST => "Asynchronous Event Request",
            a::KEEP_ALIVE => "Keep Alive",
            _ => "Admin command",
        }
    } else {
        match opcode {
            io::READ => "Read",
            io::WRITE => "Write",
            io::FLUSH => "Flush",
            io::WRITE_ZEROES => "Write Zeroes",
            io::DATASET_MANAGEMENT => "Dataset Management",
            io::RESERVATION_REGISTER => "Reservation Register",
            io::RESERVATION_REPORT => "Reservation Report",
            io::RESERVATION_ACQUIRE => "Reservation Acquire",
            io::RESERVATION_RELEASE => "Reservation Release",
            io::COMPARE => "Compare",
            _ => "I/O command",
        }
    }
}

/// Maps an `nvmf-rdma` error to the initiator's.
pub(crate) fn rdma_error(addr: &str, e: nvmf_rdma::Error) -> Error {
    match e {
        nvmf_rdma::Error::Unavailable(why) => Error::RdmaUnavailable(why),
        nvmf_rdma::Error::Rejected {
            status,
            private_data,
        } => match nvmf_rdma::nvme::parse_reject(&private_data) {
            // Status 0 is no NVMe reject status: the transport refused (nothing listens).
            Some(s) if s != 0 => Error::Refused(format!(
                "{addr} rejected the NVMe/RDMA connection: {} ({s:#x})",
                nvmf_rdma::nvme::reject_reason(s)
            )),
            _ => Error::Rdma {
                addr: addr.to_string(),
                reason: format!(
                    "connection rejected (RDMA-CM reason {status}): does an NVMe/RDMA target listen there?"
                ),
            },
        },
        nvmf_rdma::Error::Os {
            op: "ibv_reg_mr",
            source,
        } if source.raw_os_error() == Some(ENOMEM) => Error::Rdma {
            addr: addr.to_string(),
            reason: format!(
                "ibv_reg_mr: {source} (registered memory counts against RLIMIT_MEMLOCK: raise it, e.g. `ulimit -l unlimited` or LimitMEMLOCK=infinity)"
            ),
        },
        e => Error::Rdma {
            addr: addr.to_string(),
            reason: e.to_string(),
        },
    }
}

/// Maps the error of registering caller memory.
pub(crate) fn registration_error(e: nvmf_rdma::Error) -> Error {
    rdma_error("memory registration", e)
}

/// `ENOMEM` on Linux.
const ENOMEM: i32 = 12;

// Statuses written to the completion words of GPU request rings (`crate::ring_proxy`).

/// Status written for a ring read that timed out (Path Related Status, Command Aborted By
/// Host: the host gave up on it).
pub const STATUS_TIMEOUT: u16 = (sct::PATH as u16) << 8 | 0x71;
/// Status written for a ring read that failed because the connection or the controller is
/// gone (Path Related Status, Host Pathing Error: reads interrupted by a lost connection are
/// resent, so this means reconnecting gave up, or the queue was closed).
pub const STATUS_PATH_ERROR: u16 = (sct::PATH as u16) << 8 | 0x70;
/// Status written for a ring read that failed on the host for another reason (Generic
/// Internal Error).
pub const STATUS_INTERNAL: u16 = generic::INTERNAL_ERROR as u16;

/// The status field (SCT << 8 | SC) written to a ring's completion word for a read's result:
/// the completion's own status, [`STATUS_TIMEOUT`], [`STATUS_PATH_ERROR`] or
/// [`STATUS_INTERNAL`].
pub(crate) fn ring_status(result: &Result<Cqe, Error>) -> u16 {
    let field = |s: Status| (u16::from(s.sct & 0x7) << 8) | u16::from(s.sc);
    match result {
        Ok(cqe) => field(cqe.status()),
        Err(Error::Status { status, .. }) => field(*status),
        Err(Error::Timeout { .. }) => STATUS_TIMEOUT,
        Err(e) if e.is_transport() => STATUS_PATH_ERROR,
        Err(Error::Closed | Error::ControllerFailed { .. }) => STATUS_PATH_ERROR,
        Err(_) => STATUS_INTERNAL,
    }
}

#[cfg(test)]
mod tests {
    use nvme_spec::Status;

    #[test]
    fn connect_refusals_name_host_and_subsystem() {
        let refused = |sc| {
            Error::status_of(
                "Connect",
                Status {
                    sct: sct::COMMAND_SPECIFIC,
                    sc,
                    dnr: true,
                    more: false,
                },
            )
        };
        let host = refused(0x84);
        assert_eq!(host.class(), ErrorClass::Status);
        let hint = connect_hint(&host, "nqn.h:1", "nqn.s:1").unwrap();
        assert!(
            hint.contains("does not allow host nqn.h:1 on subsystem nqn.s:1"),
            "{hint}"
        );
        let hint = connect_hint(&refused(0x82), "nqn.h:1", "nqn.s:1").unwrap();
        assert!(
            hint.contains("subsystem nqn.s:1 is not on the target"),
            "{hint}"
        );
        assert!(connect_hint(&refused(0x81), "nqn.h:1", "nqn.s:1").is_none());
        assert!(connect_hint(&Error::Closed, "nqn.h:1", "nqn.s:1").is_none());
        let via = Error::ViaDaemon {
            class: ErrorClass::Target,
            message: "cannot attach x".into(),
        };
        assert_eq!(via.class(), ErrorClass::Target);
        assert_eq!(Error::Daemon("x".into()).class(), ErrorClass::Daemon);
    }

    use super::*;

    #[test]
    fn status_error_carries_name() {
        let e = Error::status_of(
            "Read",
            Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr(),
        );
        assert_eq!(e.status().map(|s| s.sc), Some(generic::LBA_OUT_OF_RANGE));
        let msg = e.to_string();
        assert!(msg.contains("Read failed: LBA Out of Range"), "{msg}");
        match e {
            Error::Status { name, .. } => assert_eq!(name, "LBA Out of Range"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn command_specific_names_depend_on_the_command() {
        let st = Status::specific(0x83).with_dnr();
        assert_eq!(status_name("Connect", st), "Connect Restart Discovery");
        let e = Error::status_of("Write Zeroes", st);
        assert_eq!(
            e.to_string(),
            "Write Zeroes failed: Command Size Limit Exceeded (ONCS Not Supported) (sct 0x1, sc 0x83, dnr)"
        );
    }

    #[test]
    fn command_names() {
        assert_eq!(command_name(false, 0x02, 0), "Read");
        assert_eq!(command_name(true, 0x06, 0), "Identify");
        assert_eq!(command_name(true, 0x7F, 0x01), "Connect");
        assert_eq!(command_name(false, 0x7F, 0x08), "Disconnect");
        assert_eq!(fes_name(2), "PDU Sequence Error");
    }

    #[test]
    fn statuses_of_results() {
        let ok = Cqe::new(1, Status::SUCCESS, 0);
        assert_eq!(ring_status(&Ok(ok)), 0);
        let lba = Cqe::new(1, Status::generic(generic::LBA_OUT_OF_RANGE), 0);
        assert_eq!(ring_status(&Ok(lba)), 0x0080);
        let media = Status {
            sct: sct::MEDIA,
            sc: 0x81,
            dnr: true,
            more: true,
        };
        assert_eq!(ring_status(&Ok(Cqe::new(1, media, 0))), 0x0281);
        let e = Error::status_of("Read", media);
        assert_eq!(ring_status(&Err(e)), 0x0281);
        let t = Error::timeout("Read", std::time::Duration::from_secs(1));
        assert_eq!(ring_status(&Err(t)), 0x0371);
        assert_eq!(ring_status(&Err(Error::lost("t", "gone"))), 0x0370);
        assert_eq!(ring_status(&Err(Error::Closed)), 0x0370);
        let b = Error::Buffer("x".into());
        assert_eq!(ring_status(&Err(b)), 0x0006);
    }
}
