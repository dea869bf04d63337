//! A small async iSCSI initiator (RFC 7143) for the load generator's `iscsi` mode.
//!
//! It logs in to a target (security stage with `AuthMethod=None`, then the operational
//! stage offering immediate data, no initial R2T, 256 KiB receive segments and first burst,
//! 1 MiB bursts and no digests), checks a LUN with READ CAPACITY(16), and runs READ(16) and
//! WRITE(16) commands from many tasks at once over one connection per [`Session`]: write data
//! goes as immediate data, then unsolicited Data-Out up to the first burst, then Data-Out
//! answering R2Ts; read data lands straight in the caller's buffer. CHECK CONDITION sense
//! data is decoded ([`scsi::Sense`]); the target's pings are answered; logout is graceful.
//!
//! | module | what |
//! |---|---|
//! | [`pdu`] | the Basic Header Segment, PDU builders and the typed decode of target PDUs |
//! | [`login`] | login text keys and the sans-IO login state machine |
//! | [`scsi`] | CDBs, READ CAPACITY data, status and sense decoding |
//! | [`session`] | the tokio session: connect, commands, the reader task, logout |
//!
//! What it must not do: wait without a deadline (connect, login and every command have one;
//! a missed deadline, a protocol error or a dropped connection ends the session and fails
//! every command in flight with one line saying why), or trust a length from the wire (a data
//! segment beyond what was negotiated, or data outside the command's buffer, ends the
//! session). It has no error recovery beyond level 0, no CHAP, no digests, no multiple
//! connections per session (several sessions give several connections) and no discovery
//! (SendTargets): the target name is given.
#![forbid(unsafe_code)]

pub mod login;
pub mod pdu;
pub mod scsi;
pub mod session;

pub use pdu::DataDir;
pub use scsi::{Capacity, Sense};
pub use session::{DEFAULT_INITIATOR_NAME, Error, Lun, Session, SessionConfig};
