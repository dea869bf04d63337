//! Sans-IO NVMe in-band authentication (DH-HMAC-CHAP, NVMe Base 2.0 section 8.13.5) and the
//! NVMe/TCP TLS pre-shared key derivations (NVMe/TCP Transport 1.0 section 3.6.1).
//!
//! - [`HostAuth`] and [`CtrlAuth`] are the two sides of one DH-HMAC-CHAP transaction: enums
//!   behind one transition function each. The host sends AUTH_Negotiate, receives the
//!   Challenge, sends its Reply, receives Success1 and, when it asked the controller to
//!   authenticate itself, checks the controller's response and sends Success2. Problems are
//!   answered with AUTH_Failure2 (host) or AUTH_Failure1 (controller) carrying the reason
//!   code explanation the specification gives: a wrong key (authentication failed), no hash
//!   or DH group in common, a wrong transaction ID or payload (including a DH value of the
//!   wrong size or out of range), a message out of order.
//! - [`DhchapKey`] parses and writes the `DHHC-1:XX:<base64>:` secrets of `nvme
//!   gen-dhchap-key` and the Linux target's configfs, and performs the key transformation.
//! - [`dhchap`] holds the response and augmented-challenge computations, [`dh`] the RFC 7919
//!   groups, [`tls`] the `NVMeTLSkey-1` interchange format, retained PSK, PSK digest, TLS PSK
//!   and PSK identities (versions 0 and 1).
//! - [`fuzzing`] drives both state machines with arbitrary input for the fuzz targets.
//! - [`Secret`] wraps every key: its `Debug` prints only the length and it is zeroed on drop.
//!
//! The wire formats are [`nvme_spec::auth`]'s. Randomness (challenges, sequence numbers, DH
//! private values) comes from the caller's [`rand_core::CryptoRng`].
//!
//! What this crate must not do: perform I/O, spawn tasks, depend on an async runtime, read
//! the clock, log or print key material, use `unsafe`, or panic on any input. The transports
//! (NVMe/TCP and RDMA, host and target) carry the messages in Authentication Send/Receive
//! commands and apply the outcome.
#![forbid(unsafe_code)]

mod common;
mod ctrl;
pub mod dh;
pub mod dhchap;
mod error;
pub mod fuzzing;
pub mod hash;
mod host;
mod keys;
mod secret;
pub mod tls;

pub use ctrl::{CtrlAction, CtrlAuth, CtrlConfig, CtrlEvent, DhWork};
pub use error::{AuthError, Outcome};
pub use host::{HostAuth, HostConfig, HostEvent, HostNext, HostStep};
pub use keys::{DhchapKey, KeyError};
pub use nvme_spec::auth::{DhGroupId, FailureExplanation, HashId};
pub use secret::Secret;

/// Allocation length for the host's Authentication Receive: enough for a Challenge with an
/// ffdhe8192 value (the Linux host uses the same size).
pub const MAX_MESSAGE_LEN: usize = 4096;
