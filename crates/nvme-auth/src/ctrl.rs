//! The controller side of DH-HMAC-CHAP: the host's Authentication Send commands deliver
//! Negotiate, Reply and Success2; its Authentication Receive commands fetch the Challenge,
//! Success1 or Failure1 this side has queued.

use nvme_spec::Status;
use nvme_spec::auth::{AuthMessage, DhGroupId, FailureExplanation as Fx, HashId, Protocol, sc_c};
use nvme_spec::status::generic;
use rand_core::CryptoRng;

use crate::common::{self, receive};
use crate::dh::DhKeyPair;
use crate::dhchap;
use crate::error::{AuthError, Fail, Outcome, ours};
use crate::keys::DhchapKey;
use crate::secret::ct_eq;

/// Controller settings for one host.
#[derive(Clone, Debug)]
pub struct CtrlConfig {
    /// Subsystem NQN.
    pub subnqn: String,
    /// Host NQN.
    pub hostnqn: String,
    /// The host's secret.
    pub host_key: DhchapKey,
    /// The controller's secret, needed when the host asks for bidirectional authentication.
    pub ctrl_key: Option<DhchapKey>,
    /// Hash functions accepted, preferred first.
    pub hashes: Vec<HashId>,
    /// DH groups accepted, preferred first.
    pub dh_groups: Vec<DhGroupId>,
}

impl CtrlConfig {
    /// Settings that accept every hash and DH group, preferring SHA-256 and the smallest FFDHE
    /// group, the null group last.
    pub fn new(subnqn: &str, hostnqn: &str, host_key: DhchapKey) -> Self {
        Self {
            subnqn: subnqn.to_string(),
            hostnqn: hostnqn.to_string(),
            host_key,
            ctrl_key: None,
            hashes: HashId::ALL.to_vec(),
            dh_groups: vec![
                DhGroupId::Ffdhe2048,
                DhGroupId::Ffdhe3072,
                DhGroupId::Ffdhe4096,
                DhGroupId::Ffdhe6144,
                DhGroupId::Ffdhe8192,
                DhGroupId::Null,
            ],
        }
    }
}

/// An input to the controller state machine: one authentication command from the host.
#[derive(Clone, Copy, Debug)]
pub enum CtrlEvent<'a> {
    /// Authentication Send with this payload (after the transport checked SECP/SPSP with
    /// [`nvme_spec::auth::AuthCommand::is_dhchap`]).
    Send(&'a [u8]),
    /// Authentication Receive with this allocation length.
    Receive {
        /// Allocation length in bytes.
        len: u32,
    },
}

/// How to complete the command.
#[derive(Debug, PartialEq, Eq)]
pub enum CtrlAction {
    /// Complete the Authentication Send successfully. (A failure found in its message is
    /// returned as Failure1 by the next Authentication Receive.)
    Accepted,
    /// Complete the Authentication Receive with this data.
    Data(Vec<u8>),
    /// Complete the command with this status: a Receive with nothing to return (Command
    /// Sequence Error) or with an allocation length too small for the message (Invalid Field).
    Error(Status),
}

#[derive(Debug)]
enum State {
    AwaitNegotiate,
    /// A message waits for the host's Authentication Receive; `then` follows once it is read.
    Pending {
        msg: Vec<u8>,
        then: Box<State>,
    },
    AwaitReply(Box<Round>),
    AwaitSuccess2(Outcome),
    Done(Outcome),
    Failed(AuthError),
}

#[derive(Debug)]
struct Round {
    hash: HashId,
    group: DhGroupId,
    c1: Vec<u8>,
    s1: u32,
    kp: Option<DhKeyPair>,
}

/// The modular exponentiation a message would cost ([`CtrlAuth::dh_work`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DhWork {
    /// An AUTH_Negotiate selecting an FFDHE group: the controller's key pair is generated.
    Negotiate,
    /// A DH-HMAC-CHAP_Reply to an FFDHE Challenge: the shared secret is computed.
    Reply,
}

/// The controller side of DH-HMAC-CHAP on one queue. A new AUTH_Negotiate starts a new
/// transaction (re-authentication).
#[derive(Debug)]
pub struct CtrlAuth {
    cfg: CtrlConfig,
    t_id: u16,
    state: State,
}

impl CtrlAuth {
    /// A controller waiting for the host's AUTH_Negotiate.
    pub fn new(cfg: CtrlConfig) -> Self {
        Self {
            cfg,
            t_id: 0,
            state: State::AwaitNegotiate,
        }
    }

    /// The transition function.
    pub fn handle(&mut self, ev: CtrlEvent<'_>, rng: &mut impl CryptoRng) -> CtrlAction {
        let state = std::mem::replace(&mut self.state, State::AwaitNegotiate);
        let (state, action) = match ev {
            CtrlEvent::Receive { len } => match state {
                State::Pending { msg, then } if msg.len() <= len as usize => {
                    (*then, CtrlAction::Data(msg))
                }
                s @ State::Pending { .. } => (
                    s,
                    CtrlAction::Error(Status::generic(generic::INVALID_FIELD)),
                ),
                s => (
                    s,
                    CtrlAction::Error(Status::generic(generic::COMMAND_SEQUENCE_ERROR)),
                ),
            },
            CtrlEvent::Send(raw) => {
                let next = self.on_send(state, raw, rng).unwrap_or_else(|f| match f {
                    Fail::Ours(e, _) => State::Pending {
                        msg: common::failure(true, self.t_id, e),
                        then: Box::new(State::Failed(f.into_error())),
                    },
                    Fail::Theirs(_) => State::Failed(f.into_error()),
                });
                (next, CtrlAction::Accepted)
            }
        };
        self.state = state;
        action
    }

    fn on_send(
        &mut self,
        state: State,
        raw: &[u8],
        rng: &mut impl CryptoRng,
    ) -> Result<State, Fail> {
        let t_id = match state {
            State::AwaitNegotiate | State::Done(_) | State::Failed(_) => None,
            _ => Some(self.t_id),
        };
        let msg = receive(raw, t_id)?;
        match (state, msg) {
            (
                _,
                AuthMessage::Negotiate {
                    t_id,
                    sc_c,
                    protocols,
                },
            ) => {
                self.t_id = t_id;
                self.on_negotiate(sc_c, &protocols, rng)
            }
            (State::AwaitReply(round), m @ AuthMessage::Reply { .. }) => self.on_reply(*round, m),
            (State::AwaitSuccess2(o), AuthMessage::Success2 { .. }) => Ok(State::Done(o)),
            _ => ours(Fx::IncorrectMessage, "message out of order"),
        }
    }

    /// Whether handling the Authentication Send payload `raw` now would perform a modular
    /// exponentiation: an AUTH_Negotiate that selects an FFDHE group (key pair generation) or
    /// a Reply to such a Challenge (shared secret). Cheap (a parse, no arithmetic), so that a
    /// caller can budget or move the expensive messages elsewhere before calling
    /// [`CtrlAuth::handle`].
    pub fn dh_work(&self, raw: &[u8]) -> Option<DhWork> {
        match AuthMessage::parse(raw).ok()? {
            AuthMessage::Negotiate {
                sc_c, protocols, ..
            } => {
                let (_, group) = self.choose(sc_c, &protocols).ok()?;
                (group != DhGroupId::Null).then_some(DhWork::Negotiate)
            }
            AuthMessage::Reply { t_id, .. } => match &self.state {
                State::AwaitReply(round) if round.kp.is_some() && t_id == self.t_id => {
                    Some(DhWork::Reply)
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// Ends the transaction that the AUTH_Negotiate `raw` starts without doing its work: the
    /// next Authentication Receive returns AUTH_Failure1 with the reason code explanation
    /// "authentication failed", and [`CtrlAuth::outcome`] reports `detail`. For a caller
    /// that refuses the work (a budget spent, no room to do it); `raw` that is not an
    /// AUTH_Negotiate fails the transaction the same way.
    pub fn refuse(&mut self, raw: &[u8], detail: &'static str) {
        if let Ok(AuthMessage::Negotiate { t_id, .. }) = AuthMessage::parse(raw) {
            self.t_id = t_id;
        }
        let f = Fail::Ours(Fx::Failed, detail);
        self.state = State::Pending {
            msg: common::failure(true, self.t_id, Fx::Failed),
            then: Box::new(State::Failed(f.into_error())),
        };
    }

    /// The hash and DH group for a host's AUTH_Negotiate.
    fn choose(&self, sc: u8, protocols: &[Protocol]) -> Result<(HashId, DhGroupId), Fail> {
        if sc != sc_c::NONE {
            return ours(
                Fx::ConcatMismatch,
                "secure channel concatenation not supported",
            );
        }
        let Some(p) = protocols.iter().find_map(|p| match p {
            Protocol::Dhchap(d) => Some(d),
            Protocol::Other(_) => None,
        }) else {
            return ours(
                Fx::ProtocolUnusable,
                "host offered no DH-HMAC-CHAP descriptor",
            );
        };
        let Some(hash) = self
            .cfg
            .hashes
            .iter()
            .copied()
            .find(|h| p.hash_ids.contains(&(*h as u8)))
        else {
            return ours(Fx::HashUnusable, "no hash function in common");
        };
        let Some(group) = self
            .cfg
            .dh_groups
            .iter()
            .copied()
            .find(|g| p.dh_group_ids.contains(&(*g as u8)))
        else {
            return ours(Fx::DhGroupUnusable, "no DH group in common");
        };
        Ok((hash, group))
    }

    fn on_negotiate(
        &self,
        sc: u8,
        protocols: &[Protocol],
        rng: &mut impl CryptoRng,
    ) -> Result<State, Fail> {
        let (hash, group) = self.choose(sc, protocols)?;
        let round = Round {
            hash,
            group,
            c1: common::challenge(hash, rng),
            s1: common::seqnum(rng),
            kp: common::key_pair(group, rng)?,
        };
        let msg = AuthMessage::Challenge {
            t_id: self.t_id,
            hash_id: hash as u8,
            dh_group_id: group as u8,
            seqnum: round.s1,
            challenge: round.c1.clone(),
            dh_value: round
                .kp
                .as_ref()
                .map(|k| k.public_value().to_vec())
                .unwrap_or_default(),
        };
        Ok(State::Pending {
            msg: msg.encode(),
            then: Box::new(State::AwaitReply(Box::new(round))),
        })
    }

    fn on_reply(&self, round: Round, msg: AuthMessage) -> Result<State, Fail> {
        let AuthMessage::Reply {
            cvalid,
            seqnum,
            response,
            challenge,
            dh_value,
            ..
        } = msg
        else {
            return ours(Fx::IncorrectMessage, "expected DH-HMAC-CHAP_Reply");
        };
        let (cfg, hash) = (&self.cfg, round.hash);
        if response.len() != hash.digest_len() {
            return ours(
                Fx::IncorrectPayload,
                "response length differs from the hash length",
            );
        }
        let session = common::session_key(round.group, round.kp.as_ref(), &dh_value)?;
        let expected = dhchap::host_response(
            hash,
            cfg.host_key.transformed(&cfg.hostnqn).expose(),
            &common::augment(hash, session.as_ref(), &round.c1),
            round.s1,
            self.t_id,
            sc_c::NONE,
            &cfg.hostnqn,
            &cfg.subnqn,
        );
        if !ct_eq(&expected, &response) {
            return ours(Fx::Failed, "host response mismatch (wrong key)");
        }
        let outcome = Outcome {
            hash,
            dh_group: round.group,
            bidirectional: cvalid,
        };
        let hl = hash.digest_len() as u8;
        if !cvalid {
            let msg = AuthMessage::Success1 {
                t_id: self.t_id,
                hl,
                response: None,
            };
            return Ok(State::Pending {
                msg: msg.encode(),
                then: Box::new(State::Done(outcome)),
            });
        }
        if seqnum == 0 {
            return ours(
                Fx::IncorrectPayload,
                "controller challenge with sequence number 0",
            );
        }
        if ct_eq(&challenge, &round.c1) {
            return ours(Fx::Failed, "host reflected the controller's challenge");
        }
        let Some(ctrl_key) = &cfg.ctrl_key else {
            return ours(
                Fx::Failed,
                "bidirectional authentication without a controller key",
            );
        };
        let r2 = dhchap::ctrl_response(
            hash,
            ctrl_key.transformed(&cfg.subnqn).expose(),
            &common::augment(hash, session.as_ref(), &challenge),
            seqnum,
            self.t_id,
            &cfg.hostnqn,
            &cfg.subnqn,
        );
        let msg = AuthMessage::Success1 {
            t_id: self.t_id,
            hl,
            response: Some(r2),
        };
        Ok(State::Pending {
            msg: msg.encode(),
            then: Box::new(State::AwaitSuccess2(outcome)),
        })
    }

    /// The result so far: `None` while the transaction runs. A result counts from the moment
    /// it is decided, before the host has read the Success1 or Failure1 that reports it.
    pub fn outcome(&self) -> Option<Result<Outcome, AuthError>> {
        let mut s = &self.state;
        if let State::Pending { then, .. } = s {
            s = then;
        }
        match s {
            State::Done(o) => Some(Ok(*o)),
            State::Failed(e) => Some(Err(e.clone())),
            _ => None,
        }
    }
}
