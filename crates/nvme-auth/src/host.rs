//! The host side of DH-HMAC-CHAP: Negotiate, then Challenge -> Reply, then Success1 and, when
//! the host authenticates the controller too, Success2.

use nvme_spec::auth::{
    AuthMessage, DhGroupId, DhchapProtocol, FailureExplanation as Fx, HashId, Protocol, sc_c,
};
use rand_core::CryptoRng;

use crate::common::{self, receive};
use crate::dhchap;
use crate::error::{AuthError, Fail, Outcome, ours};
use crate::keys::DhchapKey;
use crate::secret::ct_eq;

/// Host settings for one controller.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// Host NQN.
    pub hostnqn: String,
    /// Subsystem NQN.
    pub subnqn: String,
    /// The host's secret.
    pub host_key: DhchapKey,
    /// The controller's secret: when set, the host asks the controller to authenticate itself
    /// (bidirectional authentication).
    pub ctrl_key: Option<DhchapKey>,
    /// Hash functions offered, preferred first.
    pub hashes: Vec<HashId>,
    /// DH groups offered, preferred first.
    pub dh_groups: Vec<DhGroupId>,
}

impl HostConfig {
    /// Settings that offer every hash and DH group, as the Linux host does.
    pub fn new(hostnqn: &str, subnqn: &str, host_key: DhchapKey) -> Self {
        Self {
            hostnqn: hostnqn.to_string(),
            subnqn: subnqn.to_string(),
            host_key,
            ctrl_key: None,
            hashes: HashId::ALL.to_vec(),
            dh_groups: DhGroupId::ALL.to_vec(),
        }
    }
}

/// An input to the host state machine.
#[derive(Clone, Copy, Debug)]
pub enum HostEvent<'a> {
    /// Begin the transaction (after the Connect that asked for authentication).
    Start,
    /// The data returned by the Authentication Receive the last step asked for.
    Received(&'a [u8]),
}

/// What the transport does next.
#[derive(Debug, PartialEq, Eq)]
pub enum HostNext {
    /// Issue an Authentication Receive (of [`crate::MAX_MESSAGE_LEN`] bytes) and pass its
    /// data back as [`HostEvent::Received`].
    Receive,
    /// The controller accepted the host (after `send`, if any, completes).
    Authenticated(Outcome),
    /// Authentication failed (after `send`, the Failure2, if any, completes).
    Failed(AuthError),
}

/// One step: a message to send with Authentication Send, then what follows.
#[derive(Debug, PartialEq, Eq)]
pub struct HostStep {
    /// Payload of an Authentication Send to issue first.
    pub send: Option<Vec<u8>>,
    /// What follows.
    pub next: HostNext,
}

#[derive(Debug)]
enum State {
    Idle,
    AwaitChallenge,
    AwaitSuccess1 {
        outcome: Outcome,
        expected_r2: Option<Vec<u8>>,
    },
    Done(Outcome),
    Failed(AuthError),
}

/// The host side of one DH-HMAC-CHAP transaction on one queue.
#[derive(Debug)]
pub struct HostAuth {
    cfg: HostConfig,
    t_id: u16,
    state: State,
}

impl HostAuth {
    /// A transaction with identifier `t_id` (the Linux host counts them per controller).
    pub fn new(cfg: HostConfig, t_id: u16) -> Self {
        Self {
            cfg,
            t_id,
            state: State::Idle,
        }
    }

    /// The transition function.
    pub fn handle(&mut self, ev: HostEvent<'_>, rng: &mut impl CryptoRng) -> HostStep {
        let state = std::mem::replace(&mut self.state, State::Idle);
        let result = match (state, ev) {
            (State::Idle, HostEvent::Start) => Ok(self.negotiate()),
            (State::AwaitChallenge, HostEvent::Received(raw)) => {
                receive(raw, Some(self.t_id)).and_then(|m| self.on_challenge(m, rng))
            }
            (
                State::AwaitSuccess1 {
                    outcome,
                    expected_r2,
                },
                HostEvent::Received(raw),
            ) => receive(raw, Some(self.t_id))
                .and_then(|m| self.on_success1(m, outcome, expected_r2)),
            (State::Done(o), _) => Ok((State::Done(o), None)),
            (State::Failed(e), _) => Ok((State::Failed(e), None)),
            (_, HostEvent::Start) => ours(Fx::IncorrectMessage, "transaction already started"),
            (State::Idle, HostEvent::Received(_)) => ours(
                Fx::IncorrectMessage,
                "message before the transaction started",
            ),
        };
        let (state, send) = result.unwrap_or_else(|f| {
            let send = match f {
                Fail::Ours(e, _) => Some(common::failure(false, self.t_id, e)),
                Fail::Theirs(_) => None,
            };
            (State::Failed(f.into_error()), send)
        });
        let next = match &state {
            State::Done(o) => HostNext::Authenticated(*o),
            State::Failed(e) => HostNext::Failed(e.clone()),
            _ => HostNext::Receive,
        };
        self.state = state;
        HostStep { send, next }
    }

    fn negotiate(&self) -> (State, Option<Vec<u8>>) {
        let msg = AuthMessage::Negotiate {
            t_id: self.t_id,
            sc_c: sc_c::NONE,
            protocols: vec![Protocol::Dhchap(DhchapProtocol {
                hash_ids: self.cfg.hashes.iter().map(|h| *h as u8).collect(),
                dh_group_ids: self.cfg.dh_groups.iter().map(|g| *g as u8).collect(),
            })],
        };
        (State::AwaitChallenge, Some(msg.encode()))
    }

    fn on_challenge(
        &self,
        msg: AuthMessage,
        rng: &mut impl CryptoRng,
    ) -> Result<(State, Option<Vec<u8>>), Fail> {
        let AuthMessage::Challenge {
            hash_id,
            dh_group_id,
            seqnum,
            challenge,
            dh_value,
            ..
        } = msg
        else {
            return ours(Fx::IncorrectMessage, "expected DH-HMAC-CHAP_Challenge");
        };
        let cfg = &self.cfg;
        let Some(hash) = HashId::from_u8(hash_id).filter(|h| cfg.hashes.contains(h)) else {
            return ours(
                Fx::HashUnusable,
                "controller chose a hash the host did not offer",
            );
        };
        let Some(group) = DhGroupId::from_u8(dh_group_id).filter(|g| cfg.dh_groups.contains(g))
        else {
            return ours(
                Fx::DhGroupUnusable,
                "controller chose a DH group the host did not offer",
            );
        };
        if challenge.len() != hash.digest_len() {
            return ours(
                Fx::IncorrectPayload,
                "challenge length differs from the hash length",
            );
        }
        if group != DhGroupId::Null && dh_value.len() != group.value_len() {
            return ours(Fx::IncorrectPayload, "DH value has the wrong size");
        }
        let kp = common::key_pair(group, rng)?;
        let session = common::session_key(group, kp.as_ref(), &dh_value)?;
        let response = dhchap::host_response(
            hash,
            cfg.host_key.transformed(&cfg.hostnqn).expose(),
            &common::augment(hash, session.as_ref(), &challenge),
            seqnum,
            self.t_id,
            sc_c::NONE,
            &cfg.hostnqn,
            &cfg.subnqn,
        );
        let (c2, s2, expected_r2) = match &cfg.ctrl_key {
            None => (vec![0; hash.digest_len()], 0, None),
            Some(k) => {
                let c2 = common::challenge(hash, rng);
                let s2 = common::seqnum(rng);
                let r2 = dhchap::ctrl_response(
                    hash,
                    k.transformed(&cfg.subnqn).expose(),
                    &common::augment(hash, session.as_ref(), &c2),
                    s2,
                    self.t_id,
                    &cfg.hostnqn,
                    &cfg.subnqn,
                );
                (c2, s2, Some(r2))
            }
        };
        let outcome = Outcome {
            hash,
            dh_group: group,
            bidirectional: expected_r2.is_some(),
        };
        let reply = AuthMessage::Reply {
            t_id: self.t_id,
            cvalid: expected_r2.is_some(),
            seqnum: s2,
            response,
            challenge: c2,
            dh_value: kp.map(|k| k.public_value().to_vec()).unwrap_or_default(),
        };
        Ok((
            State::AwaitSuccess1 {
                outcome,
                expected_r2,
            },
            Some(reply.encode()),
        ))
    }

    fn on_success1(
        &self,
        msg: AuthMessage,
        outcome: Outcome,
        expected_r2: Option<Vec<u8>>,
    ) -> Result<(State, Option<Vec<u8>>), Fail> {
        let AuthMessage::Success1 { response, .. } = msg else {
            return ours(Fx::IncorrectMessage, "expected DH-HMAC-CHAP_Success1");
        };
        match (expected_r2, response) {
            (None, _) => Ok((State::Done(outcome), None)),
            (Some(exp), Some(r2)) if ct_eq(&exp, &r2) => {
                let success2 = AuthMessage::Success2 { t_id: self.t_id }.encode();
                Ok((State::Done(outcome), Some(success2)))
            }
            (Some(_), Some(_)) => ours(Fx::Failed, "controller response mismatch (wrong key)"),
            (Some(_), None) => ours(Fx::Failed, "controller sent no response"),
        }
    }

    /// The result so far: `None` while the transaction runs.
    pub fn outcome(&self) -> Option<Result<Outcome, AuthError>> {
        match &self.state {
            State::Done(o) => Some(Ok(*o)),
            State::Failed(e) => Some(Err(e.clone())),
            _ => None,
        }
    }
}
