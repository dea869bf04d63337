//! In-band authentication (DH-HMAC-CHAP) on the target, per queue.
//!
//! A host listed in a subsystem's `[[subsystem.host]]` tables must authenticate every queue it
//! connects, the admin queue and each I/O queue: the Connect completion carries AUTHREQ.ATR,
//! the host runs a DH-HMAC-CHAP transaction in Authentication Send/Receive commands on that
//! queue, and until the transaction succeeds every other command but Disconnect is refused
//! with Authentication Required (SCT 1h, SC 91h). A new AUTH_Negotiate on an authenticated
//! queue starts a re-authentication; the queue keeps working while it runs and is refused
//! again if it fails.
//!
//! The protocol is [`nvme_auth::CtrlAuth`]'s; this module carries its messages in the
//! commands and applies the outcome. It never logs key material: keys are
//! [`nvme_auth::DhchapKey`]s, whose `Debug` is redacted, and only outcomes are logged.
//!
//! Authentication work is bounded ([`crate::ratelimit::AuthWork`]). The two messages that cost a modular
//! exponentiation (an AUTH_Negotiate that picks an FFDHE group, up to 19 ms of CPU for
//! ffdhe8192, and the Reply that follows) never run on a reactor: their Authentication Send
//! is held and handed to a small pool of threads with a bounded queue, and completes
//! through the queue's event channel when the work is done. Each AUTH_Negotiate with a
//! Diffie-Hellman exchange takes a token from its host NQN's and its source address's
//! budgets ([`crate::ratelimit::AuthBudget`]); over budget, or with the pool's queue full,
//! the transaction fails with AUTH_Failure1 "authentication failed", is logged
//! (rate-limited) and counted in `nvmeof_auth_failures_total`. The refused Authentication
//! Send completes only after [`REFUSAL_DELAY`] (a timer, no thread), so that a flooder
//! that retries as soon as it is refused retries at most once per delay and queue, and its
//! refusals cost the target little.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nvme_auth::{CtrlAuth, CtrlConfig};
use nvme_spec::{Cqe, Status};
use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

/// Largest Authentication Send payload accepted: an AUTH_Reply with two SHA-512 values and
/// an ffdhe8192 public value is 1,168 bytes.
pub(crate) const MAX_SEND_LEN: u32 = 4096;
/// How long the Authentication Send of a transaction refused for a budget or busy threads
/// is held before it completes.
pub const REFUSAL_DELAY: std::time::Duration = std::time::Duration::from_millis(500);

/// The authentication state of one queue.
pub struct QueueAuth {
    /// The protocol state; a pool thread holds it while it works on a message.
    pub(crate) proto: Arc<Mutex<CtrlAuth>>,
    /// Set while a message is with the pool.
    pub(crate) busy: Arc<AtomicBool>,
    /// Where the completion of a held Authentication Send goes (the queue's event channel).
    pub(crate) done: UnboundedSender<Cqe>,
    authenticated: bool,
    /// Whether the current transaction's outcome has been applied and logged.
    pub(crate) settled: bool,
    /// Why this side refused the current transaction without doing its work.
    pub(crate) refused: Option<&'static str>,
}

impl std::fmt::Debug for QueueAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueAuth")
            .field("authenticated", &self.authenticated)
            .field("busy", &self.busy.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What an authentication command comes to.
pub(crate) enum Answer {
    Now(Status, Option<Vec<u8>>),
    /// Handed to the pool: completes through the event channel.
    Held,
}

/// The metrics label of a failed transaction.
pub(crate) fn failure_reason(e: &nvme_auth::AuthError) -> &'static str {
    use nvme_auth::FailureExplanation as Fx;
    match e {
        nvme_auth::AuthError::Received { .. } => "host_reported_failure",
        nvme_auth::AuthError::Sent { explanation, .. } => match explanation {
            Fx::Failed => "failed",
            Fx::ProtocolUnusable => "protocol_unusable",
            Fx::ConcatMismatch => "concat_mismatch",
            Fx::HashUnusable => "hash_unusable",
            Fx::DhGroupUnusable => "dh_group_unusable",
            Fx::IncorrectPayload => "incorrect_payload",
            Fx::IncorrectMessage => "incorrect_message",
        },
    }
}

impl QueueAuth {
    /// A queue that must authenticate `hostnqn` to `subnqn` with `keys`; held completions go
    /// to `done`.
    pub fn new(
        subnqn: &str,
        hostnqn: &str,
        keys: &crate::subsystem::HostKeys,
        done: UnboundedSender<Cqe>,
    ) -> Self {
        let mut cfg = CtrlConfig::new(subnqn, hostnqn, keys.host.clone());
        cfg.ctrl_key = keys.ctrl.clone();
        if let Some(h) = keys.hash {
            cfg.hashes = vec![h];
        }
        if let Some(g) = keys.dh_group {
            cfg.dh_groups = vec![g];
        }
        QueueAuth {
            proto: Arc::new(Mutex::new(CtrlAuth::new(cfg))),
            busy: Arc::new(AtomicBool::new(false)),
            done,
            authenticated: false,
            settled: false,
            refused: None,
        }
    }

    /// Completes a refused transaction's Authentication Send (`template`: its completion)
    /// after [`REFUSAL_DELAY`], through the event channel; the queue takes no other
    /// authentication message meanwhile. Outside a runtime (unit tests of the protocol)
    /// completes at once.
    pub(crate) fn hold_refusal(&self, template: Cqe) -> Answer {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return Answer::Now(Status::SUCCESS, None);
        };
        let (busy, done) = (Arc::clone(&self.busy), self.done.clone());
        busy.store(true, Ordering::Release);
        rt.spawn(async move {
            tokio::time::sleep(REFUSAL_DELAY).await;
            busy.store(false, Ordering::Release);
            let _ = done.send(template);
        });
        Answer::Held
    }

    /// Whether the queue may run commands other than authentication ones.
    pub fn is_authenticated(&self) -> bool {
        self.authenticated
    }

    pub(crate) fn busy(&self) -> bool {
        self.busy.load(Ordering::Acquire)
    }

    /// Applies a decided outcome once per transaction; returns it for logging when new.
    pub(crate) fn settle(&mut self) -> Option<Result<nvme_auth::Outcome, nvme_auth::AuthError>> {
        let outcome = self.proto.try_lock()?.outcome();
        match outcome {
            None => {
                self.settled = false;
                None
            }
            Some(_) if self.settled => None,
            Some(r) => {
                self.settled = true;
                self.authenticated = r.is_ok();
                Some(r)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use nvme_auth::{DhGroupId, DhchapKey, HashId, HostAuth, HostConfig, HostEvent, HostNext};
    use nvme_spec::fabrics::{Cc, ConnectData, property};
    use nvme_spec::queue::SglDescriptor;
    use nvme_spec::{IntoBytes, status::sct};

    use nvme_spec::Sqe;
    use nvme_spec::auth::AuthCommand;
    use nvme_spec::command::FabricsCommand;
    use nvme_spec::fabrics::CONNECT_AUTHREQ_ATR;
    use nvme_spec::status::{generic, specific};

    use super::*;
    use crate::config::HostAuthConfig;
    use crate::queue::{QueueState, Submit};
    use crate::target::Target;
    use crate::testing::{HOST, NQN, connect_sqe, origin, status};

    fn key(byte: u8) -> DhchapKey {
        DhchapKey::new(nvme_auth::Secret::new(vec![byte; 32]), Some(HashId::Sha256)).unwrap()
    }

    /// A target whose subsystem requires [`HOST`] to authenticate with `key(1)` (and, with
    /// `ctrl_key`, to be answered with `key(2)`).
    fn target(ctrl_key: bool) -> Arc<Target> {
        let mut cfg = crate::testing::config(&["mem:1M"]);
        let s = &mut cfg.subsystems[0];
        s.allow_any_host = false;
        s.auth_hosts.push(HostAuthConfig {
            nqn: HOST.to_string(),
            dhchap_key: Some(key(1)),
            tls_psk: None,
            dhchap_ctrl_key: ctrl_key.then(|| key(2)),
            dhchap_hash: None,
            dhchap_dhgroup: None,
        });
        cfg.validate().unwrap();
        Target::build(&cfg).unwrap()
    }

    /// Connects queue `qid` (controller `cntlid` for an I/O queue); returns the queue and
    /// the Connect completion's DW0.
    fn connect(t: &Arc<Target>, qid: u16, cntlid: u16) -> (QueueState, u32) {
        let mut q = QueueState::new(Arc::clone(t), origin());
        let data = ConnectData::new([7; 16], cntlid, NQN, HOST);
        match q.submit(&connect_sqe(qid, false), data.as_bytes()) {
            Submit::Complete(c) => {
                assert!(c.status().is_success(), "{}", c.status());
                (q, c.dw0.get())
            }
            _ => panic!("Connect answered without a completion"),
        }
    }

    fn auth_sqe(cid: u16, cmd: AuthCommand) -> Sqe {
        let mut sqe = FabricsCommand::AuthSend.encode(cid);
        cmd.write_to_sqe(&mut sqe);
        sqe.dptr = if cmd.send {
            SglDescriptor::in_capsule(cmd.len)
        } else {
            SglDescriptor::tcp_transport(cmd.len)
        };
        sqe
    }

    fn host_cfg(host_key: DhchapKey, ctrl_key: Option<DhchapKey>) -> HostConfig {
        let mut c = HostConfig::new(HOST, NQN, host_key);
        c.ctrl_key = ctrl_key;
        c
    }

    /// Runs the host side of a transaction over `q`'s commands, as a transport carries them.
    fn authenticate(q: &mut QueueState, cfg: HostConfig, t_id: u16) -> HostNext {
        let mut rng = rand::rng();
        let mut host = HostAuth::new(cfg, t_id);
        let mut step = host.handle(HostEvent::Start, &mut rng);
        loop {
            if let Some(msg) = step.send.take() {
                let sqe = auth_sqe(t_id, AuthCommand::send(msg.len() as u32));
                assert_eq!(send(q, &sqe, &msg), Status::SUCCESS);
            }
            match step.next {
                HostNext::Receive => {
                    let sqe = auth_sqe(t_id, AuthCommand::receive(4096));
                    let Submit::CompleteWithData(d, c) = q.submit(&sqe, &[]) else {
                        panic!("Authentication Receive returned no data");
                    };
                    assert!(c.status().is_success());
                    step = host.handle(HostEvent::Received(&d), &mut rng);
                }
                done => return done,
            }
        }
    }

    /// Submits an Authentication Send; a held one is waited for on the queue's event
    /// channel, where the transport would.
    fn send(q: &mut QueueState, sqe: &Sqe, msg: &[u8]) -> Status {
        match q.submit(sqe, msg) {
            Submit::Held => {
                let cqe = q.events.as_mut().unwrap().blocking_recv().unwrap();
                assert_eq!(cqe.cid(), sqe.cid());
                assert_eq!(cqe.sqid.get(), q.qid);
                cqe.status()
            }
            other => status(other),
        }
    }

    fn enable(q: &mut QueueState) -> Status {
        let cc = FabricsCommand::PropertySet {
            size8: false,
            offset: property::CC,
            value: u64::from(Cc::enable_value()),
        }
        .encode(1);
        status(q.submit(&cc, &[]))
    }

    fn auth_required() -> Status {
        Status::specific(specific::AUTH_REQUIRED).with_dnr()
    }

    #[test]
    fn every_queue_is_refused_until_it_authenticates() {
        let t = target(false);
        let (mut admin, dw0) = connect(&t, 0, 0xFFFF);
        assert_eq!(dw0 & CONNECT_AUTHREQ_ATR, CONNECT_AUTHREQ_ATR);
        let st = enable(&mut admin);
        assert_eq!((st, st.sct), (auth_required(), sct::COMMAND_SPECIFIC));
        assert_eq!(st.to_field() & 0x7ff, 0x191, "SCT/SC as Linux spells them");
        let next = authenticate(&mut admin, host_cfg(key(1), None), 1);
        assert!(matches!(next, HostNext::Authenticated(o) if !o.bidirectional));
        assert_eq!(enable(&mut admin), Status::SUCCESS);
        let sf = nvme_spec::command::build::set_features(2, 7, 0x0001_0001);
        assert_eq!(status(admin.submit(&sf, &[])), Status::SUCCESS);

        let cntlid = admin.ctrl.as_ref().unwrap().cntlid;
        let (mut io, dw0) = connect(&t, 1, cntlid);
        assert_eq!(dw0 & CONNECT_AUTHREQ_ATR, CONNECT_AUTHREQ_ATR);
        assert!(io.auth_pending());
        let flush = nvme_spec::command::build::flush(3, 1);
        assert_eq!(status(io.submit(&flush, &[])), auth_required());
        authenticate(&mut io, host_cfg(key(1), None), 2);
        assert!(!io.auth_pending());
        assert_eq!(status(io.submit(&flush, &[])), Status::SUCCESS);
    }

    #[test]
    fn every_hash_and_group_authenticates_both_ways() {
        let t = target(true);
        for hash in HashId::ALL {
            for group in [DhGroupId::Null, DhGroupId::Ffdhe2048, DhGroupId::Ffdhe3072] {
                let (mut admin, _) = connect(&t, 0, 0xFFFF);
                let mut cfg = host_cfg(key(1), Some(key(2)));
                cfg.hashes = vec![hash];
                cfg.dh_groups = vec![group];
                let next = authenticate(&mut admin, cfg, 7);
                let want = nvme_auth::Outcome {
                    hash,
                    dh_group: group,
                    bidirectional: true,
                };
                assert_eq!(next, HostNext::Authenticated(want));
                assert!(!admin.auth_pending());
            }
        }
    }

    #[test]
    fn wrong_keys_and_unexpected_controller_keys_are_refused() {
        let t = target(false);
        let cases = [
            (
                host_cfg(key(3), None),
                nvme_auth::FailureExplanation::Failed,
            ),
            // The host asks the controller to authenticate, which has no key to do it.
            (
                host_cfg(key(1), Some(key(2))),
                nvme_auth::FailureExplanation::Failed,
            ),
        ];
        for (cfg, why) in cases {
            let (mut admin, _) = connect(&t, 0, 0xFFFF);
            match authenticate(&mut admin, cfg, 1) {
                HostNext::Failed(e) => assert_eq!(e.explanation(), why as u8, "{e}"),
                other => panic!("{other:?}"),
            }
            assert!(admin.auth_pending());
            assert_eq!(enable(&mut admin), auth_required());
        }
        // The controller's answer is checked too: a wrong controller key fails at the host.
        let t = target(true);
        let (mut admin, _) = connect(&t, 0, 0xFFFF);
        assert!(matches!(
            authenticate(&mut admin, host_cfg(key(1), Some(key(4))), 1),
            HostNext::Failed(_)
        ));
    }

    #[test]
    fn reauthentication_keeps_the_queue_until_it_fails() {
        let t = target(false);
        let (mut admin, _) = connect(&t, 0, 0xFFFF);
        authenticate(&mut admin, host_cfg(key(1), None), 1);
        assert!(matches!(
            authenticate(&mut admin, host_cfg(key(1), None), 2),
            HostNext::Authenticated(_)
        ));
        assert_eq!(enable(&mut admin), Status::SUCCESS);
        assert!(matches!(
            authenticate(&mut admin, host_cfg(key(5), None), 3),
            HostNext::Failed(_)
        ));
        assert_eq!(enable(&mut admin), auth_required());
    }

    #[test]
    fn bad_commands_get_statuses_and_bad_messages_failures() {
        let t = target(false);
        let (mut admin, _) = connect(&t, 0, 0xFFFF);
        // Another security protocol.
        let mut cmd = AuthCommand::send(8);
        cmd.secp = 0xEA;
        let st = status(admin.submit(&auth_sqe(1, cmd), &[0; 8]));
        assert_eq!(st, Status::generic(generic::INVALID_FIELD).with_dnr());
        // A transfer length past the data.
        let st = status(admin.submit(&auth_sqe(1, AuthCommand::send(64)), &[0; 8]));
        assert_eq!(
            st,
            Status::generic(generic::DATA_SGL_LENGTH_INVALID).with_dnr()
        );
        // Nothing to receive yet.
        let st = status(admin.submit(&auth_sqe(1, AuthCommand::receive(4096)), &[]));
        assert_eq!(
            st,
            Status::generic(generic::COMMAND_SEQUENCE_ERROR).with_dnr()
        );
        // A truncated message is accepted and answered with AUTH_Failure1.
        let st = status(admin.submit(&auth_sqe(1, AuthCommand::send(3)), &[0, 1, 0]));
        assert_eq!(st, Status::SUCCESS);
        let Submit::CompleteWithData(d, _) =
            admin.submit(&auth_sqe(1, AuthCommand::receive(4096)), &[])
        else {
            panic!("no Failure1")
        };
        assert!(matches!(
            nvme_spec::auth::AuthMessage::parse(&d),
            Ok(nvme_spec::auth::AuthMessage::Failure1 { .. })
        ));
        assert!(admin.auth_pending());
    }

    #[test]
    fn a_host_restricted_to_one_hash_and_group_gets_them_or_a_failure() {
        let mut cfg = crate::testing::config(&["mem:1M"]);
        cfg.subsystems[0].auth_hosts.push(HostAuthConfig {
            nqn: HOST.to_string(),
            dhchap_key: Some(key(1)),
            tls_psk: None,
            dhchap_ctrl_key: None,
            dhchap_hash: Some(HashId::Sha512),
            dhchap_dhgroup: Some(DhGroupId::Ffdhe4096),
        });
        let t = Target::build(&cfg).unwrap();
        let (mut admin, _) = connect(&t, 0, 0xFFFF);
        let want = nvme_auth::Outcome {
            hash: HashId::Sha512,
            dh_group: DhGroupId::Ffdhe4096,
            bidirectional: false,
        };
        let next = authenticate(&mut admin, host_cfg(key(1), None), 1);
        assert_eq!(next, HostNext::Authenticated(want));
        let (mut admin, _) = connect(&t, 0, 0xFFFF);
        let mut only_sha256 = host_cfg(key(1), None);
        only_sha256.hashes = vec![HashId::Sha256];
        match authenticate(&mut admin, only_sha256, 1) {
            HostNext::Failed(e) => assert_eq!(
                e.explanation(),
                nvme_auth::FailureExplanation::HashUnusable as u8
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_connected_queue_that_never_authenticates_expires_at_the_handshake_timeout() {
        use crate::engine::{Engine, Wake};
        let mut cfg = crate::testing::config(&["mem:1M"]);
        cfg.target.handshake_timeout = std::time::Duration::from_millis(50);
        cfg.subsystems[0].auth_hosts.push(HostAuthConfig {
            nqn: HOST.to_string(),
            dhchap_key: Some(key(1)),
            tls_psk: None,
            dhchap_ctrl_key: None,
            dhchap_hash: None,
            dhchap_dhgroup: None,
        });
        let t = Target::build(&cfg).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let permit = || {
            t.listener_gate("tcp://127.0.0.1:4420".parse().unwrap())
                .admit()
                .unwrap()
        };
        let (q, _) = connect(&t, 0, 0xFFFF);
        let mut e: Engine<()> = Engine::new(q, permit());
        e.watch_controller();
        assert!(matches!(rt.block_on(e.next()), Wake::HandshakeExpired));
        // Authenticated in time: the timeout no longer runs.
        let (mut q, _) = connect(&t, 0, 0xFFFF);
        authenticate(&mut q, host_cfg(key(1), None), 1);
        let mut e: Engine<()> = Engine::new(q, permit());
        e.watch_controller();
        let woke = rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_millis(200), e.next()).await
        });
        assert!(!matches!(woke, Ok(Wake::HandshakeExpired)));
    }

    #[test]
    fn negotiates_over_the_budget_fail_without_their_work() {
        let mut cfg = crate::testing::config(&["mem:1M"]);
        cfg.subsystems[0].allow_any_host = false;
        cfg.subsystems[0].auth_hosts.push(HostAuthConfig {
            nqn: HOST.to_string(),
            dhchap_key: Some(key(1)),
            tls_psk: None,
            dhchap_ctrl_key: None,
            dhchap_hash: None,
            dhchap_dhgroup: Some(DhGroupId::Ffdhe2048),
        });
        cfg.target.auth_rate = 1;
        cfg.target.auth_burst = 2;
        let t = Target::build(&cfg).unwrap();
        let (mut admin, _) = connect(&t, 0, 0xFFFF);
        for t_id in 1..=2 {
            let next = authenticate(&mut admin, host_cfg(key(1), None), t_id);
            assert!(matches!(next, HostNext::Authenticated(_)), "{next:?}");
        }
        // The third in the same second: refused with "authentication failed", at once.
        match authenticate(&mut admin, host_cfg(key(1), None), 3) {
            HostNext::Failed(e) => {
                assert_eq!(e.explanation(), nvme_auth::FailureExplanation::Failed as u8)
            }
            other => panic!("{other:?}"),
        }
        assert!(admin.auth_pending());
        let snap = t.metrics_snapshot();
        assert_eq!(snap.auth_failures.get("host_over_budget"), Some(&1));
        // On a reactor the refused Send completes only after the refusal delay (a lower
        // bound: a timer never fires early).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut host = HostAuth::new(host_cfg(key(1), None), 4);
            let msg = host
                .handle(HostEvent::Start, &mut rand::rng())
                .send
                .unwrap();
            let sqe = auth_sqe(4, AuthCommand::send(msg.len() as u32));
            let start = std::time::Instant::now();
            assert!(matches!(admin.submit(&sqe, &msg), Submit::Held));
            let cqe = admin.events.as_mut().unwrap().recv().await.unwrap();
            assert!(cqe.status().is_success());
            assert!(start.elapsed() >= REFUSAL_DELAY);
        });
        let receive = auth_sqe(4, AuthCommand::receive(4096));
        let Submit::CompleteWithData(d, _) = admin.submit(&receive, &[]) else {
            panic!("Authentication Receive returned no data");
        };
        assert!(matches!(
            nvme_spec::auth::AuthMessage::parse(&d),
            Ok(nvme_spec::auth::AuthMessage::Failure1 { .. })
        ));
        // Only Diffie-Hellman exchanges are budgeted: the null group still works.
        let mut null = cfg.clone();
        null.subsystems[0].auth_hosts[0].dhchap_dhgroup = Some(DhGroupId::Null);
        let t = Target::build(&null).unwrap();
        let (mut admin, _) = connect(&t, 0, 0xFFFF);
        for t_id in 1..=5 {
            let next = authenticate(&mut admin, host_cfg(key(1), None), t_id);
            assert!(matches!(next, HostNext::Authenticated(_)), "{next:?}");
        }
    }

    #[test]
    fn hosts_without_keys_are_not_asked_to_authenticate() {
        let t = crate::testing::target(&["mem:1M"]);
        let (_, dw0) = connect(&t, 0, 0xFFFF);
        assert_eq!(dw0 & CONNECT_AUTHREQ_ATR, 0);
    }
}
