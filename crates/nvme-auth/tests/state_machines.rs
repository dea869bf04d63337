//! The host and controller state machines against each other and against crafted messages:
//! every transition and every failure path.

use nvme_auth::dhchap::host_response;
use nvme_auth::{
    AuthError, CtrlAction, CtrlAuth, CtrlConfig, CtrlEvent, DhGroupId, DhchapKey,
    FailureExplanation as Fx, HashId, HostAuth, HostConfig, HostEvent, HostNext, MAX_MESSAGE_LEN,
    Outcome, Secret,
};
use nvme_spec::Status;
use nvme_spec::auth::{AuthMessage, DhchapProtocol, Protocol};
use nvme_spec::status::generic;
use proptest::prelude::*;
use rand::SeedableRng;
use rand::rngs::StdRng;

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0f0e0d0c-0b0a-4908-8706-050403020100";
const SUBNQN: &str = "nqn.2024-01.io.nvmeof-direct:auth-test";

fn rng() -> StdRng {
    StdRng::seed_from_u64(0x5eed)
}

fn key(byte: u8, transform: Option<HashId>) -> DhchapKey {
    DhchapKey::new(Secret::new(vec![byte; 32]), transform).unwrap()
}

fn host_cfg(hashes: &[HashId], groups: &[DhGroupId], bidi: bool) -> HostConfig {
    let mut c = HostConfig::new(HOSTNQN, SUBNQN, key(1, Some(HashId::Sha256)));
    c.hashes = hashes.to_vec();
    c.dh_groups = groups.to_vec();
    c.ctrl_key = bidi.then(|| key(2, Some(HashId::Sha384)));
    c
}

fn ctrl_cfg() -> CtrlConfig {
    let mut c = CtrlConfig::new(SUBNQN, HOSTNQN, key(1, Some(HashId::Sha256)));
    c.ctrl_key = Some(key(2, Some(HashId::Sha384)));
    c
}

type Results = (
    Option<Result<Outcome, AuthError>>,
    Option<Result<Outcome, AuthError>>,
);

/// Runs one transaction, carrying every message over, as the transport would.
fn exchange(host: &mut HostAuth, ctrl: &mut CtrlAuth, rng: &mut StdRng) -> Results {
    let mut step = host.handle(HostEvent::Start, rng);
    loop {
        if let Some(m) = step.send.take() {
            assert_eq!(ctrl.handle(CtrlEvent::Send(&m), rng), CtrlAction::Accepted);
        }
        if step.next != HostNext::Receive {
            break;
        }
        let CtrlAction::Data(data) = ctrl.handle(
            CtrlEvent::Receive {
                len: MAX_MESSAGE_LEN as u32,
            },
            rng,
        ) else {
            panic!("controller had nothing to return");
        };
        step = host.handle(HostEvent::Received(&data), rng);
    }
    (host.outcome(), ctrl.outcome())
}

fn run(host: HostConfig, ctrl: CtrlConfig) -> Results {
    let mut rng = rng();
    exchange(
        &mut HostAuth::new(host, 1),
        &mut CtrlAuth::new(ctrl),
        &mut rng,
    )
}

fn sent(explanation: Fx) -> impl Fn(&AuthError) -> bool {
    move |e| matches!(e, AuthError::Sent { explanation: x, .. } if *x == explanation)
}

fn received(explanation: Fx) -> impl Fn(&AuthError) -> bool {
    move |e| {
        *e == AuthError::Received {
            explanation: explanation as u8,
        }
    }
}

#[test]
fn succeeds_for_every_hash_null_and_ffdhe_groups_both_directions() {
    let groups = [DhGroupId::Null, DhGroupId::Ffdhe2048, DhGroupId::Ffdhe3072];
    for hash in HashId::ALL {
        for group in groups {
            for bidi in [false, true] {
                let (h, c) = run(host_cfg(&[hash], &[group], bidi), ctrl_cfg());
                let want = Outcome {
                    hash,
                    dh_group: group,
                    bidirectional: bidi,
                };
                assert_eq!(h, Some(Ok(want)), "{hash:?} {group:?} bidi={bidi}");
                assert_eq!(c, Some(Ok(want)), "{hash:?} {group:?} bidi={bidi}");
            }
        }
    }
}

#[test]
fn largest_group_succeeds() {
    let host = host_cfg(&[HashId::Sha512], &[DhGroupId::Ffdhe8192], true);
    let (h, c) = run(host, ctrl_cfg());
    let want = Outcome {
        hash: HashId::Sha512,
        dh_group: DhGroupId::Ffdhe8192,
        bidirectional: true,
    };
    assert_eq!((h, c), (Some(Ok(want)), Some(Ok(want))));
}

#[test]
fn controller_picks_its_preferred_hash_and_group_among_those_offered() {
    let mut ctrl = ctrl_cfg();
    ctrl.hashes = vec![HashId::Sha512, HashId::Sha256];
    ctrl.dh_groups = vec![DhGroupId::Ffdhe3072, DhGroupId::Ffdhe2048];
    let host = host_cfg(
        &HashId::ALL,
        &[DhGroupId::Null, DhGroupId::Ffdhe2048],
        false,
    );
    let (h, c) = run(host, ctrl);
    let want = Outcome {
        hash: HashId::Sha512,
        dh_group: DhGroupId::Ffdhe2048,
        bidirectional: false,
    };
    assert_eq!((h, c), (Some(Ok(want)), Some(Ok(want))));
}

#[test]
fn wrong_host_key_is_answered_with_failure1() {
    for group in [DhGroupId::Null, DhGroupId::Ffdhe2048] {
        let mut host = host_cfg(&[HashId::Sha256], &[group], false);
        host.host_key = key(9, Some(HashId::Sha256));
        let (h, c) = run(host, ctrl_cfg());
        assert!(received(Fx::Failed)(&h.unwrap().unwrap_err()));
        assert!(sent(Fx::Failed)(&c.unwrap().unwrap_err()));
    }
    // Same bytes, different transformation: a different key.
    let mut host = host_cfg(&[HashId::Sha256], &[DhGroupId::Null], false);
    host.host_key = key(1, None);
    assert!(received(Fx::Failed)(
        &run(host, ctrl_cfg()).0.unwrap().unwrap_err()
    ));
}

#[test]
fn wrong_controller_key_is_answered_with_failure2() {
    for group in [DhGroupId::Null, DhGroupId::Ffdhe2048] {
        let mut host = host_cfg(&[HashId::Sha384], &[group], true);
        host.ctrl_key = Some(key(7, Some(HashId::Sha384)));
        let (h, c) = run(host, ctrl_cfg());
        assert!(sent(Fx::Failed)(&h.unwrap().unwrap_err()));
        assert!(received(Fx::Failed)(&c.unwrap().unwrap_err()));
    }
}

#[test]
fn bidirectional_without_a_controller_key_fails() {
    let mut ctrl = ctrl_cfg();
    ctrl.ctrl_key = None;
    let (h, c) = run(host_cfg(&[HashId::Sha256], &[DhGroupId::Null], true), ctrl);
    assert!(received(Fx::Failed)(&h.unwrap().unwrap_err()));
    assert!(sent(Fx::Failed)(&c.unwrap().unwrap_err()));
}

#[test]
fn no_hash_or_group_in_common() {
    let mut ctrl = ctrl_cfg();
    ctrl.hashes = vec![HashId::Sha256];
    let (h, c) = run(host_cfg(&[HashId::Sha512], &[DhGroupId::Null], false), ctrl);
    assert!(received(Fx::HashUnusable)(&h.unwrap().unwrap_err()));
    assert!(sent(Fx::HashUnusable)(&c.unwrap().unwrap_err()));

    let mut ctrl = ctrl_cfg();
    ctrl.dh_groups = vec![DhGroupId::Null, DhGroupId::Ffdhe2048];
    let (h, c) = run(
        host_cfg(&[HashId::Sha256], &[DhGroupId::Ffdhe4096], false),
        ctrl,
    );
    assert!(received(Fx::DhGroupUnusable)(&h.unwrap().unwrap_err()));
    assert!(sent(Fx::DhGroupUnusable)(&c.unwrap().unwrap_err()));
}

// ----- The host against crafted controller messages -------------------------------------

fn challenge(t_id: u16, hash: u8, group: u8, hl: usize, dh: Vec<u8>) -> Vec<u8> {
    AuthMessage::Challenge {
        t_id,
        hash_id: hash,
        dh_group_id: group,
        seqnum: 1,
        challenge: vec![0x11; hl],
        dh_value: dh,
    }
    .encode()
}

/// Starts a host (transaction 5) and feeds it `msg`: returns the Failure2 explanation it sent.
fn host_fails_on(cfg: HostConfig, msg: &[u8]) -> u8 {
    let mut rng = rng();
    let mut host = HostAuth::new(cfg, 5);
    let start = host.handle(HostEvent::Start, &mut rng);
    assert!(start.send.is_some() && start.next == HostNext::Receive);
    let step = host.handle(HostEvent::Received(msg), &mut rng);
    let Some(AuthMessage::Failure2 {
        t_id: 5,
        reason: 1,
        explanation,
    }) = step.send.as_deref().map(|m| AuthMessage::parse(m).unwrap())
    else {
        panic!("no Failure2: {step:?}");
    };
    assert!(matches!(
        step.next,
        HostNext::Failed(AuthError::Sent { .. })
    ));
    // Nothing more happens once failed.
    let again = host.handle(HostEvent::Received(msg), &mut rng);
    assert_eq!(again.send, None);
    assert!(matches!(again.next, HostNext::Failed(_)));
    explanation
}

#[test]
fn host_failure_paths() {
    let all = host_cfg(
        &HashId::ALL,
        &[DhGroupId::Null, DhGroupId::Ffdhe2048],
        false,
    );
    let sha256 = host_cfg(&[HashId::Sha256], &[DhGroupId::Null], false);
    let x = |e: Fx| e as u8;
    // Hash and group the host did not offer, or unknown values.
    assert_eq!(
        host_fails_on(sha256.clone(), &challenge(5, 2, 0, 48, vec![])),
        x(Fx::HashUnusable)
    );
    assert_eq!(
        host_fails_on(sha256.clone(), &challenge(5, 9, 0, 48, vec![])),
        x(Fx::HashUnusable)
    );
    assert_eq!(
        host_fails_on(sha256.clone(), &challenge(5, 1, 1, 32, vec![2; 256])),
        x(Fx::DhGroupUnusable)
    );
    assert_eq!(
        host_fails_on(all.clone(), &challenge(5, 1, 7, 32, vec![])),
        x(Fx::DhGroupUnusable)
    );
    // Wrong transaction ID.
    assert_eq!(
        host_fails_on(all.clone(), &challenge(6, 1, 0, 32, vec![])),
        x(Fx::IncorrectPayload)
    );
    // Challenge length not the hash length.
    assert_eq!(
        host_fails_on(all.clone(), &challenge(5, 1, 0, 48, vec![])),
        x(Fx::IncorrectPayload)
    );
    // DH values: oversized, undersized, out of range, and one sent with the null group.
    for dh in [vec![2; 300], vec![2; 255], vec![0; 256], vec![0xFF; 256]] {
        let c = challenge(5, 1, 1, 32, dh);
        assert_eq!(host_fails_on(all.clone(), &c), x(Fx::IncorrectPayload));
    }
    assert_eq!(
        host_fails_on(all.clone(), &challenge(5, 1, 0, 32, vec![2; 8])),
        x(Fx::IncorrectPayload)
    );
    // Out of order: Success1 where the Challenge belongs.
    let s1 = AuthMessage::Success1 {
        t_id: 5,
        hl: 32,
        response: None,
    }
    .encode();
    assert_eq!(host_fails_on(all.clone(), &s1), x(Fx::IncorrectMessage));
    // Malformed.
    assert_eq!(host_fails_on(all, &[1, 1, 0]), x(Fx::IncorrectPayload));
}

#[test]
fn host_stops_on_failure1_without_answering() {
    let mut rng = rng();
    let mut host = HostAuth::new(host_cfg(&HashId::ALL, &[DhGroupId::Null], false), 3);
    host.handle(HostEvent::Start, &mut rng);
    let f1 = AuthMessage::Failure1 {
        t_id: 3,
        reason: 1,
        explanation: 4,
    }
    .encode();
    let step = host.handle(HostEvent::Received(&f1), &mut rng);
    assert_eq!(step.send, None);
    assert_eq!(
        step.next,
        HostNext::Failed(AuthError::Received {
            explanation: Fx::HashUnusable as u8
        })
    );
    let HostNext::Failed(e) = step.next else {
        unreachable!()
    };
    assert_eq!(
        e.to_string(),
        "peer reported failure: hash function not usable"
    );
}

#[test]
fn host_events_out_of_order() {
    let mut rng = rng();
    let mut host = HostAuth::new(host_cfg(&HashId::ALL, &[DhGroupId::Null], false), 3);
    let step = host.handle(HostEvent::Received(&[0; 16]), &mut rng);
    assert!(matches!(
        step.next,
        HostNext::Failed(AuthError::Sent {
            explanation: Fx::IncorrectMessage,
            ..
        })
    ));
    let mut host = HostAuth::new(host_cfg(&HashId::ALL, &[DhGroupId::Null], false), 3);
    host.handle(HostEvent::Start, &mut rng);
    let step = host.handle(HostEvent::Start, &mut rng);
    assert!(matches!(
        step.next,
        HostNext::Failed(AuthError::Sent {
            explanation: Fx::IncorrectMessage,
            ..
        })
    ));
}

#[test]
fn host_rejects_a_missing_controller_response() {
    // A controller that answers a bidirectional Reply with a Success1 lacking R2.
    let mut rng = rng();
    let mut host = HostAuth::new(host_cfg(&[HashId::Sha256], &[DhGroupId::Null], true), 4);
    host.handle(HostEvent::Start, &mut rng);
    host.handle(
        HostEvent::Received(&challenge(4, 1, 0, 32, vec![])),
        &mut rng,
    );
    let s1 = AuthMessage::Success1 {
        t_id: 4,
        hl: 32,
        response: None,
    }
    .encode();
    let step = host.handle(HostEvent::Received(&s1), &mut rng);
    assert!(matches!(
        step.next,
        HostNext::Failed(AuthError::Sent {
            explanation: Fx::Failed,
            ..
        })
    ));
    let f2 = AuthMessage::parse(&step.send.unwrap()).unwrap();
    assert_eq!(
        f2,
        AuthMessage::Failure2 {
            t_id: 4,
            reason: 1,
            explanation: Fx::Failed as u8
        }
    );
}

// ----- The controller against crafted host messages -------------------------------------

fn negotiate(t_id: u16, sc_c: u8, protocols: Vec<Protocol>) -> Vec<u8> {
    AuthMessage::Negotiate {
        t_id,
        sc_c,
        protocols,
    }
    .encode()
}

fn dhchap(hashes: &[u8], groups: &[u8]) -> Protocol {
    Protocol::Dhchap(DhchapProtocol {
        hash_ids: hashes.to_vec(),
        dh_group_ids: groups.to_vec(),
    })
}

fn recv(ctrl: &mut CtrlAuth, rng: &mut StdRng) -> AuthMessage {
    match ctrl.handle(
        CtrlEvent::Receive {
            len: MAX_MESSAGE_LEN as u32,
        },
        rng,
    ) {
        CtrlAction::Data(d) => AuthMessage::parse(&d).unwrap(),
        other => panic!("{other:?}"),
    }
}

/// Sends `msgs` to a fresh controller and returns the Failure1 explanation it queued.
fn ctrl_fails_on(msgs: &[Vec<u8>]) -> u8 {
    let mut rng = rng();
    let mut ctrl = CtrlAuth::new(ctrl_cfg());
    for (i, m) in msgs.iter().enumerate() {
        assert_eq!(
            ctrl.handle(CtrlEvent::Send(m), &mut rng),
            CtrlAction::Accepted
        );
        if i + 1 < msgs.len() {
            recv(&mut ctrl, &mut rng);
        }
    }
    assert!(matches!(ctrl.outcome(), Some(Err(AuthError::Sent { .. }))));
    match recv(&mut ctrl, &mut rng) {
        AuthMessage::Failure1 {
            reason: 1,
            explanation,
            ..
        } => explanation,
        other => panic!("{other:?}"),
    }
}

/// A controller after Negotiate (null group, SHA-256, transaction 9) and its Challenge.
fn ctrl_challenged(rng: &mut StdRng) -> (CtrlAuth, Vec<u8>, u32) {
    let mut ctrl = CtrlAuth::new(ctrl_cfg());
    ctrl.handle(
        CtrlEvent::Send(&negotiate(9, 0, vec![dhchap(&[1], &[0])])),
        rng,
    );
    let AuthMessage::Challenge {
        challenge, seqnum, ..
    } = recv(&mut ctrl, rng)
    else {
        panic!("no challenge")
    };
    (ctrl, challenge, seqnum)
}

fn correct_r1(c1: &[u8], s1: u32, t_id: u16) -> Vec<u8> {
    let k = key(1, Some(HashId::Sha256)).transformed(HOSTNQN);
    host_response(HashId::Sha256, k.expose(), c1, s1, t_id, 0, HOSTNQN, SUBNQN)
}

fn reply(t_id: u16, cvalid: bool, seqnum: u32, r1: Vec<u8>, c2: Vec<u8>, dh: Vec<u8>) -> Vec<u8> {
    AuthMessage::Reply {
        t_id,
        cvalid,
        seqnum,
        response: r1,
        challenge: c2,
        dh_value: dh,
    }
    .encode()
}

#[test]
fn controller_negotiate_failures() {
    let x = |e: Fx| e as u8;
    assert_eq!(
        ctrl_fails_on(&[negotiate(1, 1, vec![dhchap(&[1], &[0])])]),
        x(Fx::ConcatMismatch)
    );
    assert_eq!(
        ctrl_fails_on(&[negotiate(1, 0, vec![Protocol::Other(2)])]),
        x(Fx::ProtocolUnusable)
    );
    assert_eq!(
        ctrl_fails_on(&[negotiate(1, 0, vec![dhchap(&[7], &[0])])]),
        x(Fx::HashUnusable)
    );
    assert_eq!(
        ctrl_fails_on(&[negotiate(1, 0, vec![dhchap(&[1], &[9])])]),
        x(Fx::DhGroupUnusable)
    );
    assert_eq!(ctrl_fails_on(&[vec![0, 0, 0]]), x(Fx::IncorrectPayload));
}

#[test]
fn controller_reply_failures() {
    let x = |e: Fx| e as u8;
    let mut rng = rng();
    let neg = negotiate(9, 0, vec![dhchap(&[1], &[0])]);
    let neg_dh = negotiate(9, 0, vec![dhchap(&[1], &[1])]);
    // Reply before Negotiate; Success2 before Success1.
    assert_eq!(
        ctrl_fails_on(&[reply(9, false, 0, vec![1; 32], vec![0; 32], vec![])]),
        x(Fx::IncorrectMessage)
    );
    assert_eq!(
        ctrl_fails_on(&[neg.clone(), AuthMessage::Success2 { t_id: 9 }.encode()]),
        x(Fx::IncorrectMessage)
    );
    // Wrong transaction ID, wrong response length, wrong response.
    assert_eq!(
        ctrl_fails_on(&[
            neg.clone(),
            reply(8, false, 0, vec![1; 32], vec![0; 32], vec![])
        ]),
        x(Fx::IncorrectPayload)
    );
    assert_eq!(
        ctrl_fails_on(&[
            neg.clone(),
            reply(9, false, 0, vec![1; 48], vec![0; 48], vec![])
        ]),
        x(Fx::IncorrectPayload)
    );
    assert_eq!(
        ctrl_fails_on(&[
            neg.clone(),
            reply(9, false, 0, vec![1; 32], vec![0; 32], vec![])
        ]),
        x(Fx::Failed)
    );
    // DH values: oversized, undersized, out of range; one sent with the null group.
    for dh in [vec![2; 257], vec![2; 200], vec![0; 256]] {
        assert_eq!(
            ctrl_fails_on(&[
                neg_dh.clone(),
                reply(9, false, 0, vec![1; 32], vec![0; 32], dh)
            ]),
            x(Fx::IncorrectPayload)
        );
    }
    assert_eq!(
        ctrl_fails_on(&[
            neg.clone(),
            reply(9, false, 0, vec![1; 32], vec![0; 32], vec![2; 256])
        ]),
        x(Fx::IncorrectPayload)
    );

    // A correct R1, but bidirectional with S2 = 0, or reflecting the controller's own C1.
    let (mut ctrl, c1, s1) = ctrl_challenged(&mut rng);
    ctrl.handle(
        CtrlEvent::Send(&reply(
            9,
            true,
            0,
            correct_r1(&c1, s1, 9),
            vec![3; 32],
            vec![],
        )),
        &mut rng,
    );
    assert!(matches!(
        recv(&mut ctrl, &mut rng),
        AuthMessage::Failure1 { explanation: 6, .. }
    ));
    let (mut ctrl, c1, s1) = ctrl_challenged(&mut rng);
    ctrl.handle(
        CtrlEvent::Send(&reply(
            9,
            true,
            5,
            correct_r1(&c1, s1, 9),
            c1.clone(),
            vec![],
        )),
        &mut rng,
    );
    assert!(matches!(
        recv(&mut ctrl, &mut rng),
        AuthMessage::Failure1 { explanation: 1, .. }
    ));
}

#[test]
fn replayed_reply_is_refused() {
    let mut rng = rng();
    // A correct Reply sent twice in one transaction: the second is out of order.
    let (mut ctrl, c1, s1) = ctrl_challenged(&mut rng);
    let good = reply(9, false, 0, correct_r1(&c1, s1, 9), vec![0; 32], vec![]);
    ctrl.handle(CtrlEvent::Send(&good), &mut rng);
    assert!(matches!(
        recv(&mut ctrl, &mut rng),
        AuthMessage::Success1 { response: None, .. }
    ));
    assert!(matches!(ctrl.outcome(), Some(Ok(_))));
    ctrl.handle(CtrlEvent::Send(&good), &mut rng);
    assert!(matches!(
        recv(&mut ctrl, &mut rng),
        AuthMessage::Failure1 { explanation: 7, .. }
    ));
    // Replayed into a new transaction (same T_ID): the fresh challenge makes it wrong.
    let mut rng2 = StdRng::seed_from_u64(99);
    ctrl.handle(
        CtrlEvent::Send(&negotiate(9, 0, vec![dhchap(&[1], &[0])])),
        &mut rng2,
    );
    assert!(matches!(
        recv(&mut ctrl, &mut rng2),
        AuthMessage::Challenge { .. }
    ));
    ctrl.handle(CtrlEvent::Send(&good), &mut rng2);
    assert!(matches!(
        recv(&mut ctrl, &mut rng2),
        AuthMessage::Failure1 { explanation: 1, .. }
    ));
}

#[test]
fn controller_command_sequencing() {
    let mut rng = rng();
    let mut ctrl = CtrlAuth::new(ctrl_cfg());
    let seq_err = CtrlAction::Error(Status::generic(generic::COMMAND_SEQUENCE_ERROR));
    assert_eq!(
        ctrl.handle(CtrlEvent::Receive { len: 4096 }, &mut rng),
        seq_err
    );
    ctrl.handle(
        CtrlEvent::Send(&negotiate(9, 0, vec![dhchap(&[1], &[0])])),
        &mut rng,
    );
    // Too small a buffer keeps the Challenge for the next Receive.
    assert_eq!(
        ctrl.handle(CtrlEvent::Receive { len: 16 }, &mut rng),
        CtrlAction::Error(Status::generic(generic::INVALID_FIELD))
    );
    assert!(matches!(
        recv(&mut ctrl, &mut rng),
        AuthMessage::Challenge { t_id: 9, .. }
    ));
    assert_eq!(
        ctrl.handle(CtrlEvent::Receive { len: 4096 }, &mut rng),
        seq_err
    );
    assert_eq!(ctrl.outcome(), None);
    // The host gives up with Failure2.
    let f2 = AuthMessage::Failure2 {
        t_id: 9,
        reason: 1,
        explanation: 1,
    }
    .encode();
    assert_eq!(
        ctrl.handle(CtrlEvent::Send(&f2), &mut rng),
        CtrlAction::Accepted
    );
    assert_eq!(
        ctrl.outcome(),
        Some(Err(AuthError::Received { explanation: 1 }))
    );
}

#[test]
fn reauthentication_starts_a_new_transaction() {
    let mut rng = rng();
    let mut ctrl = CtrlAuth::new(ctrl_cfg());
    for t_id in [1, 2] {
        let mut host = HostAuth::new(
            host_cfg(&[HashId::Sha256], &[DhGroupId::Ffdhe2048], true),
            t_id,
        );
        let (h, c) = exchange(&mut host, &mut ctrl, &mut rng);
        assert!(
            h.unwrap().is_ok() && c.unwrap().is_ok(),
            "transaction {t_id}"
        );
    }
}

#[test]
fn keys_stay_out_of_debug_output() {
    let host_key = key(0x5A, Some(HashId::Sha256));
    let dhhc1 = host_key.to_dhhc1();
    let b64 = dhhc1.split(':').nth(2).unwrap().to_string();
    let mut cfg = host_cfg(&HashId::ALL, &DhGroupId::ALL, true);
    cfg.host_key = host_key.clone();
    let mut rng = rng();
    let mut host = HostAuth::new(cfg, 1);
    let mut ctrl = CtrlAuth::new(CtrlConfig::new(SUBNQN, HOSTNQN, host_key));
    let shown = format!("{host:?} {ctrl:?}");
    exchange(&mut host, &mut ctrl, &mut rng);
    let after = format!("{shown} {host:?} {ctrl:?}");
    for needle in [b64.as_str(), "90, 90", "0x5a", "5a5a"] {
        assert!(!after.contains(needle), "{needle} in {after}");
    }
    assert!(after.contains("redacted"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn controller_never_panics(msgs in proptest::collection::vec(
        proptest::collection::vec(any::<u8>(), 0..200), 1..4)
    ) {
        let mut rng = rng();
        let mut ctrl = CtrlAuth::new(ctrl_cfg());
        for m in &msgs {
            prop_assert_eq!(ctrl.handle(CtrlEvent::Send(m), &mut rng), CtrlAction::Accepted);
            ctrl.handle(CtrlEvent::Receive { len: 4096 }, &mut rng);
        }
    }

    #[test]
    fn host_never_panics(msgs in proptest::collection::vec(
        proptest::collection::vec(any::<u8>(), 0..200), 1..4)
    ) {
        let mut rng = rng();
        let mut host = HostAuth::new(host_cfg(&HashId::ALL, &[DhGroupId::Null], true), 1);
        host.handle(HostEvent::Start, &mut rng);
        for m in &msgs {
            host.handle(HostEvent::Received(m), &mut rng);
        }
    }
}

#[test]
fn dh_work_names_the_messages_that_exponentiate_and_refuse_fails_the_transaction() {
    use nvme_auth::DhWork;
    let mut rng = rng();
    // An FFDHE group: the Negotiate and the Reply each cost an exponentiation.
    let mut host = HostAuth::new(
        host_cfg(&[HashId::Sha256], &[DhGroupId::Ffdhe2048], false),
        3,
    );
    let mut ctrl = CtrlAuth::new(ctrl_cfg());
    let step = host.handle(HostEvent::Start, &mut rng);
    let negotiate = step.send.unwrap();
    assert_eq!(ctrl.dh_work(&negotiate), Some(DhWork::Negotiate));
    assert_eq!(
        ctrl.handle(CtrlEvent::Send(&negotiate), &mut rng),
        CtrlAction::Accepted
    );
    let CtrlAction::Data(challenge) = ctrl.handle(CtrlEvent::Receive { len: 4096 }, &mut rng)
    else {
        panic!("no Challenge")
    };
    let reply = host
        .handle(HostEvent::Received(&challenge), &mut rng)
        .send
        .unwrap();
    assert_eq!(ctrl.dh_work(&reply), Some(DhWork::Reply));
    assert_eq!(ctrl.dh_work(&[1, 2, 3]), None, "malformed: no work");

    // The null group costs nothing.
    let mut host = HostAuth::new(host_cfg(&[HashId::Sha256], &[DhGroupId::Null], false), 4);
    let negotiate = host.handle(HostEvent::Start, &mut rng).send.unwrap();
    assert_eq!(CtrlAuth::new(ctrl_cfg()).dh_work(&negotiate), None);

    // A refused Negotiate: Failure1 "authentication failed" with its transaction ID.
    let mut host = HostAuth::new(
        host_cfg(&[HashId::Sha256], &[DhGroupId::Ffdhe8192], false),
        9,
    );
    let negotiate = host.handle(HostEvent::Start, &mut rng).send.unwrap();
    let mut ctrl = CtrlAuth::new(ctrl_cfg());
    ctrl.refuse(&negotiate, "over budget");
    let CtrlAction::Data(d) = ctrl.handle(CtrlEvent::Receive { len: 4096 }, &mut rng) else {
        panic!("no Failure1")
    };
    assert_eq!(
        AuthMessage::parse(&d).unwrap(),
        AuthMessage::Failure1 {
            t_id: 9,
            reason: nvme_spec::auth::FAILURE_REASON_AUTH_FAILED,
            explanation: Fx::Failed as u8
        }
    );
    let out = ctrl.outcome().unwrap().unwrap_err();
    assert!(
        sent(Fx::Failed)(&out) && out.to_string().contains("over budget"),
        "{out}"
    );
    assert!(matches!(
        host.handle(HostEvent::Received(&d), &mut rng).next,
        HostNext::Failed(_)
    ));
}
