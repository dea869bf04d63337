//! Drivers shared by the fuzz targets (`fuzz/`) and the replay test (`tests/fuzz_inputs.rs`):
//! what each target does with one input. The caller supplies the random source (a seeded one,
//! so that a crash reproduces).
//!
//! The state-machine targets read the input as a script of steps mixing the genuine exchange
//! between a [`HostAuth`] and a [`CtrlAuth`] with raw messages, replays of the last message
//! and bit flips in a message about to be sent, so that inputs reach every state with bad
//! messages. The drivers panic only when an invariant breaks: a side that fails must have its
//! failure message to send (the controller queues Failure1, the host sends Failure2 unless the
//! controller ended the transaction), a Send is always accepted, a Receive never returns more
//! than the host's buffer, and a parsed message encodes to itself. Any panic inside the state
//! machines or the parsers is a bug.

use nvme_spec::auth::AuthMessage;
use rand_core::CryptoRng;

use crate::{
    AuthError, CtrlAction, CtrlAuth, CtrlConfig, CtrlEvent, DhGroupId, DhchapKey, HashId, HostAuth,
    HostConfig, HostEvent, HostNext, MAX_MESSAGE_LEN, Secret,
};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0e0d0c-0b0a-4908-8706-050403020100";
const SUBNQN: &str = "nqn.2026-11.io.nvmeof-direct:fuzz";

/// Parses a message; one that parses encodes to bytes that parse to the same message.
pub fn message(data: &[u8]) {
    if let Ok(m) = AuthMessage::parse(data) {
        let again = AuthMessage::parse(&m.encode());
        assert_eq!(again.as_ref(), Ok(&m), "encode/parse round trip");
    }
}

/// The input's steps, one byte each, some followed by their operands.
struct Script<'a>(&'a [u8]);

impl Script<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }

    fn bytes(&mut self, n: usize) -> &[u8] {
        let n = n.min(self.0.len());
        let (a, rest) = self.0.split_at(n);
        self.0 = rest;
        a
    }
}

fn key(byte: u8) -> DhchapKey {
    DhchapKey::new(Secret::new(vec![byte; 32]), Some(HashId::Sha256)).expect("32-byte key")
}

/// A host and a controller whose settings the first input byte picks: bidirectional or not,
/// the right or a wrong host key, the null group or ffdhe2048.
fn pair(setup: u8) -> (HostAuth, CtrlAuth) {
    let group = if setup & 4 == 0 {
        DhGroupId::Null
    } else {
        DhGroupId::Ffdhe2048
    };
    let mut h = HostConfig::new(HOSTNQN, SUBNQN, key(if setup & 2 == 0 { 1 } else { 3 }));
    h.ctrl_key = (setup & 1 != 0).then(|| key(2));
    h.dh_groups = vec![group, DhGroupId::Null];
    let mut c = CtrlConfig::new(SUBNQN, HOSTNQN, key(1));
    c.ctrl_key = Some(key(2));
    c.dh_groups = vec![group, DhGroupId::Null];
    (HostAuth::new(h, u16::from(setup >> 3)), CtrlAuth::new(c))
}

/// Checks the invariant of a controller that has failed: the Failure1 is what the next
/// Authentication Receive returns, unless the host ended the transaction itself.
fn check_ctrl_failure(ctrl: &mut CtrlAuth, rng: &mut impl CryptoRng) {
    if let Some(Err(AuthError::Sent { .. })) = ctrl.outcome() {
        if let CtrlAction::Data(d) = ctrl.handle(CtrlEvent::Receive { len: 4096 }, rng) {
            assert!(
                matches!(AuthMessage::parse(&d), Ok(AuthMessage::Failure1 { .. })),
                "a failed controller returns Failure1"
            );
        }
    }
}

/// Drives the controller with the script: genuine host messages, raw messages, replays and
/// bit flips.
pub fn controller(data: &[u8], rng: &mut impl CryptoRng) {
    let mut s = Script(data);
    let (mut host, mut ctrl) = pair(s.byte().unwrap_or(0));
    let mut pending = host.handle(HostEvent::Start, rng).send;
    let mut last = Vec::new();
    while let Some(op) = s.byte() {
        match op % 6 {
            0 => {
                if let Some(m) = pending.take() {
                    let action = ctrl.handle(CtrlEvent::Send(&m), rng);
                    assert_eq!(action, CtrlAction::Accepted, "a Send is always accepted");
                    last = m;
                }
            }
            1 => {
                let len = u32::from(s.byte().unwrap_or(0)) * 32;
                if let CtrlAction::Data(d) = ctrl.handle(CtrlEvent::Receive { len }, rng) {
                    assert!(d.len() <= len as usize, "never more than the host's buffer");
                    pending = host.handle(HostEvent::Received(&d), rng).send;
                }
            }
            2 => {
                let n = usize::from(s.byte().unwrap_or(0)) * 8;
                let raw = s.bytes(n).to_vec();
                ctrl.handle(CtrlEvent::Send(&raw), rng);
            }
            3 => {
                ctrl.handle(CtrlEvent::Send(&last), rng);
            }
            4 => {
                let (i, x) = (usize::from(s.byte().unwrap_or(0)), s.byte().unwrap_or(1));
                if let Some(b) = pending.as_mut().and_then(|m| {
                    let n = m.len();
                    m.get_mut(i % n.max(1))
                }) {
                    *b ^= x.max(1);
                }
            }
            _ => check_ctrl_failure(&mut ctrl, rng),
        }
    }
    check_ctrl_failure(&mut ctrl, rng);
}

/// Drives the host with the script: genuine controller messages, raw ones and replays.
pub fn host(data: &[u8], rng: &mut impl CryptoRng) {
    let mut s = Script(data);
    let (mut host, mut ctrl) = pair(s.byte().unwrap_or(0));
    let mut pending = host.handle(HostEvent::Start, rng).send;
    let mut last = Vec::new();
    while let Some(op) = s.byte() {
        let was_running = host.outcome().is_none();
        let step = match op % 4 {
            0 => {
                if let Some(m) = pending.take() {
                    ctrl.handle(CtrlEvent::Send(&m), rng);
                }
                let len = MAX_MESSAGE_LEN as u32;
                match ctrl.handle(CtrlEvent::Receive { len }, rng) {
                    CtrlAction::Data(d) => {
                        last = d;
                        host.handle(HostEvent::Received(&last), rng)
                    }
                    _ => continue,
                }
            }
            1 => {
                let n = usize::from(s.byte().unwrap_or(0)) * 8;
                let raw = s.bytes(n).to_vec();
                host.handle(HostEvent::Received(&raw), rng)
            }
            2 => host.handle(HostEvent::Received(&last), rng),
            _ => host.handle(HostEvent::Start, rng),
        };
        let failed_now = matches!(step.next, HostNext::Failed(AuthError::Sent { .. }));
        if was_running && failed_now {
            let failure = step.send.as_deref().map(AuthMessage::parse);
            assert!(
                matches!(failure, Some(Ok(AuthMessage::Failure2 { .. }))),
                "a host that finds a problem sends Failure2"
            );
        }
        pending = step.send;
    }
}

/// Inputs that reach the interesting states (a whole exchange each way, a replayed Reply, a
/// tampered Reply, a wrong key, a short Receive buffer, truncated and replayed messages), by
/// target name: the start of a corpus, and what the replay test runs.
pub fn seed_inputs() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let seeds: [(&str, &str, &[u8]); 13] = [
        (
            "auth_controller",
            "one-way-null",
            b"\x00\x00\x01\x80\x00\x01\x80\x00\x01\x80\x05",
        ),
        (
            "auth_controller",
            "two-way-ffdhe2048",
            b"\x05\x00\x01\x80\x00\x01\x80\x00\x01\x80\x05",
        ),
        (
            "auth_controller",
            "replayed-reply",
            b"\x05\x00\x01\x80\x00\x03\x01\x80\x05",
        ),
        (
            "auth_controller",
            "tampered-reply",
            b"\x05\x00\x01\x80\x04\x30\xff\x00\x01\x80\x05",
        ),
        (
            "auth_controller",
            "wrong-key",
            b"\x02\x00\x01\x80\x00\x01\x80\x05",
        ),
        (
            "auth_controller",
            "short-receive",
            b"\x04\x00\x01\x01\x01\x80\x05",
        ),
        (
            "auth_controller",
            "raw-truncated",
            b"\x00\x02\x01\x00\x01\x00\x00\x00\x00\x00\x00\x00\x05",
        ),
        ("auth_host", "two-way-ffdhe2048", b"\x05\x00\x00\x00"),
        ("auth_host", "replayed-challenge", b"\x05\x00\x02\x00"),
        (
            "auth_host",
            "raw-then-start",
            b"\x01\x01\x01\xf1\x00\x00\x00\x01\x00\x01\x00\x03\x00",
        ),
        (
            "auth_message",
            "failure1",
            b"\x00\xf1\x00\x00\x01\x00\x01\x03",
        ),
        (
            "auth_message",
            "negotiate-too-many-ids",
            b"\x00\x00\x00\x00\x01\x00\x00\x01\x01\x00\xff\xff",
        ),
        (
            "auth_message",
            "challenge-truncated",
            b"\x01\x01\x00\x00\x01\x00\x20\x00\x01\x01\x00\x01",
        ),
    ];
    seeds
        .into_iter()
        .map(|(t, n, d)| (t, n, d.to_vec()))
        .collect()
}
