//! Property tests over arbitrary and near-valid input: the engines never panic, every fatal
//! error is sticky and queues a well-formed TermReq. These run the same drivers as the
//! cargo-fuzz targets in `fuzz/`, so `cargo test` exercises the same code paths.

use nvme_spec::tcp::{FatalErrorStatus, PduType};
use nvmf_tcp::fuzzing::{Coverage, drive_host, drive_target, fuzz_sqe};
use nvmf_tcp::{Digests, PduHeader};
use proptest::prelude::*;

/// One PDU (or a run of PDUs) of a generated stream, before encoding.
#[derive(Debug, Clone)]
enum Spec {
    Capsule {
        cid: u16,
        opcode: u8,
        sgl_len: u32,
        icd: usize,
    },
    /// A write command without in-capsule data followed by H2CData answering the R2T the
    /// target driver sends for it (tag = command identifier, whole length).
    WriteFlow {
        cid: u16,
        len: u32,
        chunk: u32,
    },
    H2c {
        cccid: u16,
        ttag: u16,
        datao: u32,
        len: u32,
        last: bool,
    },
    CapsuleResp {
        cid: u16,
    },
    /// C2HData for the host driver's read (command 0) then its CapsuleResp.
    ReadFlow {
        chunk: u32,
        success: bool,
    },
    /// An R2T for the host driver's write (command 1) then its CapsuleResp.
    R2tFlow {
        ttag: u16,
    },
    C2h {
        cccid: u16,
        datao: u32,
        len: u32,
        last: bool,
        success: bool,
    },
    R2t {
        cccid: u16,
        ttag: u16,
        r2to: u32,
        r2tl: u32,
    },
    TermReq {
        h2c: bool,
        data: usize,
    },
    IcReq,
    IcResp,
    Garbage(Vec<u8>),
}

/// PDUs a target receives, mostly well formed.
fn target_spec() -> impl Strategy<Value = Spec> {
    prop_oneof![
        4 => (0u16..6, prop::sample::select(vec![0u8, 1, 2, 0x7F]), 0u32..9000, 0usize..80)
            .prop_map(|(cid, opcode, sgl_len, icd)| Spec::Capsule { cid, opcode, sgl_len, icd }),
        6 => (0u16..3, 1u32..10_000, 1u32..=4096)
            .prop_map(|(c, len, chunk)| Spec::WriteFlow { cid: c * 2, len, chunk }),
        2 => (0u16..6, 0u16..6, 0u32..3, 1u32..5000, any::<bool>()).prop_map(
            |(cccid, ttag, k, len, last)| Spec::H2c { cccid, ttag, datao: k * 4096, len, last }
        ),
        1 => (0usize..140).prop_map(|data| Spec::TermReq { h2c: true, data }),
        1 => (0u16..6).prop_map(|cid| Spec::CapsuleResp { cid }),
        1 => Just(Spec::IcReq),
        1 => prop::collection::vec(any::<u8>(), 1..40).prop_map(Spec::Garbage),
    ]
}

/// PDUs a host receives, mostly well formed.
fn host_spec() -> impl Strategy<Value = Spec> {
    prop_oneof![
        4 => (1u32..=5000, any::<bool>()).prop_map(|(chunk, success)| Spec::ReadFlow { chunk, success }),
        3 => (0u16..4).prop_map(|ttag| Spec::R2tFlow { ttag }),
        2 => (0u16..6).prop_map(|cid| Spec::CapsuleResp { cid }),
        2 => (0u16..6, 0u32..3, 1u32..5000, any::<bool>(), any::<bool>()).prop_map(
            |(cccid, k, len, last, success)| Spec::C2h {
                cccid,
                datao: k * 4096,
                len,
                last: last || success,
                success
            }
        ),
        2 => (0u16..6, 0u16..6, 0u32..3, 0u32..9000)
            .prop_map(|(cccid, ttag, k, r2tl)| Spec::R2t { cccid, ttag, r2to: k * 4096, r2tl }),
        1 => (0usize..140).prop_map(|data| Spec::TermReq { h2c: false, data }),
        1 => (0u16..6).prop_map(|cid| Spec::Capsule { cid, opcode: 1, sgl_len: 0, icd: 0 }),
        1 => Just(Spec::IcResp),
        1 => prop::collection::vec(any::<u8>(), 1..40).prop_map(Spec::Garbage),
    ]
}

fn cqe(cid: u16) -> [u8; 16] {
    let mut cqe = [0u8; 16];
    cqe[12..14].copy_from_slice(&cid.to_le_bytes());
    cqe
}

/// Encodes `spec` for digests `d`; `sizes` are the host driver's read and write lengths.
fn encode(spec: &Spec, d: Digests, sizes: (u32, u32)) -> Vec<Vec<u8>> {
    let mut pdus = Vec::new();
    let mut one = |f: &mut dyn FnMut(&mut Vec<u8>)| {
        let mut out = Vec::new();
        f(&mut out);
        pdus.push(out);
    };
    match *spec {
        Spec::Capsule {
            cid,
            opcode,
            sgl_len,
            icd,
        } => one(&mut |out| {
            let h = PduHeader::capsule_cmd(d, 0, &fuzz_sqe(cid, opcode, sgl_len), icd).unwrap();
            h.append_to(out, &vec![0x11; icd]);
        }),
        Spec::WriteFlow { cid, len, chunk } => {
            one(&mut |out| {
                let h = PduHeader::capsule_cmd(d, 0, &fuzz_sqe(cid, 1, len), 0).unwrap();
                h.append_to(out, &[]);
            });
            let mut off = 0;
            while off < len {
                let n = chunk.min(len - off);
                one(&mut |out| {
                    let h = PduHeader::h2c_data(d, 0, cid, cid, off, n, off + n == len).unwrap();
                    h.append_to(out, &vec![0x22; n as usize]);
                });
                off += n;
            }
        }
        Spec::H2c {
            cccid,
            ttag,
            datao,
            len,
            last,
        } => one(&mut |out| {
            let h = PduHeader::h2c_data(d, 0, cccid, ttag, datao, len, last).unwrap();
            h.append_to(out, &vec![0x22; len as usize]);
        }),
        Spec::CapsuleResp { cid } => one(&mut |out| {
            PduHeader::capsule_resp(d, &cqe(cid)).append_to(out, &[]);
        }),
        Spec::ReadFlow { chunk, success } => {
            let len = sizes.0;
            let mut off = 0;
            while off < len {
                let n = chunk.min(len - off);
                let last = off + n == len;
                one(&mut |out| {
                    let h = PduHeader::c2h_data(d, 0, 0, off, n, last, last && success).unwrap();
                    h.append_to(out, &vec![0x33; n as usize]);
                });
                off += n;
            }
            if !success {
                one(&mut |out| PduHeader::capsule_resp(d, &cqe(0)).append_to(out, &[]));
            }
        }
        Spec::R2tFlow { ttag } => {
            one(&mut |out| PduHeader::r2t(d, 1, ttag, 0, sizes.1).append_to(out, &[]));
            one(&mut |out| PduHeader::capsule_resp(d, &cqe(1)).append_to(out, &[]));
        }
        Spec::C2h {
            cccid,
            datao,
            len,
            last,
            success,
        } => one(&mut |out| {
            let h = PduHeader::c2h_data(d, 0, cccid, datao, len, last, success).unwrap();
            h.append_to(out, &vec![0x33; len as usize]);
        }),
        Spec::R2t {
            cccid,
            ttag,
            r2to,
            r2tl,
        } => one(&mut |out| {
            PduHeader::r2t(d, cccid, ttag, r2to, r2tl).append_to(out, &[]);
        }),
        Spec::TermReq { h2c, data } => one(&mut |out| {
            let ty = if h2c {
                PduType::H2cTermReq
            } else {
                PduType::C2hTermReq
            };
            let h = PduHeader::term_req(ty, FatalErrorStatus::PduSequenceError, 0, data);
            out.extend_from_slice(h.as_bytes());
            out.resize(out.len() + data.min(128), 0x44);
        }),
        Spec::IcReq => one(&mut |out| out.extend_from_slice(PduHeader::ic_req(0, d, 0).as_bytes())),
        Spec::IcResp => {
            one(&mut |out| out.extend_from_slice(PduHeader::ic_resp(0, d, 4096).as_bytes()))
        }
        Spec::Garbage(ref g) => one(&mut |out| out.extend_from_slice(g)),
    }
    pdus
}

/// A stream of near-valid PDUs behind the driver's input header: the driver starts with a
/// valid ICReq/ICResp, and one PDU in ten gets one byte flipped.
fn stream_of(spec: BoxedStrategy<Spec>) -> impl Strategy<Value = Vec<u8>> {
    let flip = prop::option::weighted(0.1, (any::<usize>(), 1u8..=255));
    (
        any::<[u8; 5]>(),
        prop::collection::vec((spec, prop::collection::vec(flip, 8)), 0..12),
    )
        .prop_map(|(mut head, specs)| {
            head[0] |= 0x0C; // handshake, digests allowed
            let d = Digests {
                header: head[0] & 1 != 0,
                data: head[0] & 2 != 0,
            };
            let sizes = (u32::from(head[3]) * 64 + 1, u32::from(head[4]) * 64 + 1);
            let mut out = head.to_vec();
            for (s, flips) in specs {
                for (mut bytes, flip) in encode(&s, d, sizes)
                    .into_iter()
                    .zip(flips.into_iter().cycle())
                {
                    if let Some((at, x)) = flip {
                        let i = at % bytes.len();
                        bytes[i] ^= x;
                    }
                    out.extend_from_slice(&bytes);
                }
            }
            out
        })
}

fn target_stream() -> impl Strategy<Value = Vec<u8>> {
    stream_of(target_spec().boxed())
}

fn host_stream() -> impl Strategy<Value = Vec<u8>> {
    stream_of(host_spec().boxed())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn target_survives_arbitrary_bytes(input in prop::collection::vec(any::<u8>(), 0..2048)) {
        let _ = drive_target(&input);
    }

    #[test]
    fn host_survives_arbitrary_bytes(input in prop::collection::vec(any::<u8>(), 0..2048)) {
        let _ = drive_host(&input);
    }

    #[test]
    fn target_survives_near_valid_streams(input in target_stream()) {
        let _ = drive_target(&input);
    }

    #[test]
    fn host_survives_near_valid_streams(input in host_stream()) {
        let _ = drive_host(&input);
    }
}

/// The generated streams are not vacuous: across a fixed number of cases they reach every
/// kind of event and error on both sides.
#[test]
fn near_valid_streams_reach_deep_states() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let (mut target, mut host) = (Coverage::default(), Coverage::default());
    for _ in 0..2000 {
        target += drive_target(&target_stream().new_tree(&mut runner).unwrap().current());
        host += drive_host(&host_stream().new_tree(&mut runner).unwrap().current());
    }
    eprintln!("target {target:?}\nhost {host:?}");
    for (name, n) in [
        ("target connected", target.connected),
        ("commands", target.commands),
        ("h2c data", target.h2c_data),
        ("target digest errors", target.digest_errors),
        ("target term reqs", target.term_reqs),
        ("target fatal errors", target.fatal_errors),
        ("host connected", host.connected),
        ("c2h data", host.c2h_data),
        ("capsule resps", host.capsule_resps),
        ("r2ts", host.r2ts),
        ("host digest errors", host.digest_errors),
        ("host term reqs", host.term_reqs),
        ("host fatal errors", host.fatal_errors),
    ] {
        assert!(n > 0, "no {name} reached: target {target:?} host {host:?}");
    }
}

/// The fuzz seed corpus is a set of clean conversations that reach every normal event.
/// With `NVMF_TCP_FUZZ_SEED_DIR` set, the seeds are also written there (one directory per
/// fuzz target) for `fuzz/run-brief.sh`.
#[test]
fn fuzz_seeds_are_clean_conversations() {
    let (target_seeds, host_seeds) = nvmf_tcp::fuzzing::seed_inputs();
    assert_eq!((target_seeds.len(), host_seeds.len()), (8, 8));
    for seed in &target_seeds {
        let c = drive_target(seed);
        assert_eq!(c.fatal_errors, 0, "{c:?}");
        assert_eq!(
            (c.connected, c.commands, c.h2c_data, c.term_reqs),
            (1, 3, 2, 1),
            "{c:?}"
        );
    }
    for seed in &host_seeds {
        let c = drive_host(seed);
        assert_eq!(c.fatal_errors, 0, "{c:?}");
        assert_eq!(
            (c.connected, c.r2ts, c.capsule_resps, c.term_reqs),
            (1, 1, 4, 1),
            "{c:?}"
        );
        assert!(c.c2h_data >= 2, "{c:?}");
    }
    if let Some(dir) = std::env::var_os("NVMF_TCP_FUZZ_SEED_DIR") {
        let dir = std::path::PathBuf::from(dir);
        for (name, seeds) in [
            ("deframe_target", &target_seeds),
            ("deframe_host", &host_seeds),
        ] {
            let sub = dir.join(name);
            std::fs::create_dir_all(&sub).unwrap();
            for (i, seed) in seeds.iter().enumerate() {
                std::fs::write(sub.join(format!("seed-{i}")), seed).unwrap();
            }
        }
    }
}
