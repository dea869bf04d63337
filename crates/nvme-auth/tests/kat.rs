//! Known-answer tests against `kat/vectors.txt`, written by `kat/gen.py` (Python's standard
//! library only, independent of this crate's code).

use std::collections::HashMap;

use nvme_auth::dh::{self, DhKeyPair};
use nvme_auth::dhchap::{augmented_challenge, ctrl_response, host_response};
use nvme_auth::tls::ConfiguredPsk;
use nvme_auth::{DhGroupId, DhchapKey, HashId, Secret};

fn vectors() -> HashMap<&'static str, &'static str> {
    include_str!("../kat/vectors.txt")
        .lines()
        .filter_map(|l| l.split_once(' '))
        .collect()
}

struct Kat(HashMap<&'static str, &'static str>);

impl Kat {
    fn new() -> Self {
        Self(vectors())
    }

    fn s(&self, name: &str) -> &'static str {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("vector {name} missing"))
    }

    fn hex(&self, name: &str) -> Vec<u8> {
        let s = self.s(name);
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    fn num(&self, name: &str) -> u64 {
        self.s(name).parse().unwrap()
    }
}

const GROUPS: [(DhGroupId, u32); 5] = [
    (DhGroupId::Ffdhe2048, 2048),
    (DhGroupId::Ffdhe3072, 3072),
    (DhGroupId::Ffdhe4096, 4096),
    (DhGroupId::Ffdhe6144, 6144),
    (DhGroupId::Ffdhe8192, 8192),
];

#[test]
fn ffdhe_primes_match_the_rfc_7919_formula() {
    let k = Kat::new();
    for (g, bits) in GROUPS {
        let p = dh::prime(g).unwrap().to_bytes_be();
        assert_eq!(p, k.hex(&format!("ffdhe{bits}.prime")), "{g:?}");
    }
}

#[test]
fn dhhc1_parse_encode_and_transform() {
    let k = Kat::new();
    let (hostnqn, subnqn) = (k.s("hostnqn"), k.s("subnqn"));
    for name in [
        "dhhc1.32.00",
        "dhhc1.32.01",
        "dhhc1.48.02",
        "dhhc1.64.03",
        "dhhc1.64.01",
    ] {
        let secret = k.s(&format!("{name}.secret"));
        let key = DhchapKey::parse(secret).unwrap();
        assert_eq!(key.to_dhhc1(), secret, "{name}");
        let raw = DhchapKey::new(
            Secret::new(k.hex(&format!("{name}.key"))),
            key.transform_hash(),
        );
        assert_eq!(raw.unwrap(), key, "{name}");
        let crc = k.hex(&format!("{name}.crc"));
        assert_eq!(
            crc32fast::hash(&k.hex(&format!("{name}.key")))
                .to_le_bytes()
                .to_vec(),
            crc
        );
        assert_eq!(
            key.transformed(hostnqn).expose(),
            k.hex(&format!("{name}.transformed_host")),
            "{name}"
        );
        assert_eq!(
            key.transformed(subnqn).expose(),
            k.hex(&format!("{name}.transformed_ctrl")),
            "{name}"
        );
    }
}

#[test]
fn published_examples() {
    let k = Kat::new();
    // The NVMe Base specification's example secret, under each transformation.
    let spec = k.s("published.dhhc1.string");
    let key = DhchapKey::parse(spec).unwrap();
    assert_eq!(key.transform_hash(), None);
    assert_eq!(
        key.transformed("any").expose(),
        k.hex("published.dhhc1.key")
    );
    assert_eq!(key.to_dhhc1(), spec);
    assert_eq!(k.hex("published.dhhc1.crc"), [0xfa, 0x69, 0x0d, 0xa7]);
    for xx in ["01", "02", "03"] {
        let key = DhchapKey::parse(&spec.replace(":00:", &format!(":{xx}:"))).unwrap();
        assert_eq!(
            key.transformed(k.s("hostnqn")).expose(),
            k.hex(&format!("published.dhhc1.transformed_host.{xx}"))
        );
    }
    // The NVMe/TCP specification's example configured PSK.
    let tls = k.s("published.tls.string");
    let psk = ConfiguredPsk::parse(tls).unwrap();
    assert_eq!(psk.to_interchange(), tls);
    assert_eq!(k.hex("published.tls.crc"), [0x5f, 0xf4, 0xba, 0xd9]);
    assert_eq!(
        psk.retained(k.s("hostnqn")).expose(),
        k.hex("published.tls.retained")
    );
    let derived = psk.tls_psk(0, k.s("hostnqn"), k.s("subnqn")).unwrap();
    assert_eq!(derived.key.expose(), k.hex("published.tls.tls_psk0"));
}

#[test]
fn host_and_controller_responses() {
    let k = Kat::new();
    let (hostnqn, subnqn) = (k.s("hostnqn"), k.s("subnqn"));
    let host_key = DhchapKey::parse(k.s("resp.host_secret"))
        .unwrap()
        .transformed(hostnqn);
    let ctrl_key = DhchapKey::parse(k.s("resp.ctrl_secret"))
        .unwrap()
        .transformed(subnqn);
    let (s1, s2, tid) = (
        k.num("resp.seq1") as u32,
        k.num("resp.seq2") as u32,
        k.num("resp.tid"),
    );
    for h in HashId::ALL {
        let n = h as u8;
        let c1 = k.hex(&format!("resp.{n}.c1"));
        let c2 = k.hex(&format!("resp.{n}.c2"));
        let r1 = host_response(
            h,
            host_key.expose(),
            &c1,
            s1,
            tid as u16,
            0,
            hostnqn,
            subnqn,
        );
        assert_eq!(r1, k.hex(&format!("resp.{n}.host")), "{h:?}");
        let r2 = ctrl_response(h, ctrl_key.expose(), &c2, s2, tid as u16, hostnqn, subnqn);
        assert_eq!(r2, k.hex(&format!("resp.{n}.ctrl")), "{h:?}");
    }
}

#[test]
fn dh_shared_secrets_and_augmented_challenges() {
    let k = Kat::new();
    let (hostnqn, subnqn) = (k.s("hostnqn"), k.s("subnqn"));
    let host_key = DhchapKey::parse(k.s("resp.host_secret"))
        .unwrap()
        .transformed(hostnqn);
    for (g, bits) in &GROUPS[..2] {
        let v = |n: &str| k.hex(&format!("dh.{bits}.{n}"));
        let a = DhKeyPair::from_private(*g, Secret::new(v("x"))).unwrap();
        let b = DhKeyPair::from_private(*g, Secret::new(v("y"))).unwrap();
        assert_eq!(a.public_value(), v("gx"));
        assert_eq!(b.public_value(), v("gy"));
        let shared = a.shared_secret(&v("gy")).unwrap();
        assert_eq!(shared.expose(), v("shared"));
        assert_eq!(b.shared_secret(&v("gx")).unwrap(), shared);
        // A shared secret with a leading zero byte keeps the group size.
        let z = DhKeyPair::from_private(*g, Secret::new(v("z_leading_zero"))).unwrap();
        assert_eq!(z.public_value(), v("gz"));
        let lz = z.shared_secret(&v("gx")).unwrap();
        assert_eq!(lz.expose()[0], 0);
        assert_eq!(lz.len(), g.value_len());
        assert_eq!(lz.expose(), v("shared_leading_zero"));
        for h in HashId::ALL {
            let n = h as u8;
            let c1 = k.hex(&format!("resp.{n}.c1"));
            let aug = augmented_challenge(h, shared.expose(), &c1);
            assert_eq!(aug, v(&format!("aug.{n}")), "{g:?} {h:?}");
            let tid = k.num("resp.tid") as u16;
            let seq = k.num("resp.seq1") as u32;
            let r1 = host_response(h, host_key.expose(), &aug, seq, tid, 0, hostnqn, subnqn);
            assert_eq!(r1, v(&format!("host_response.{n}")), "{g:?} {h:?}");
        }
    }
}

#[test]
fn tls_psk_interchange_retained_psk_and_identities() {
    let k = Kat::new();
    let (hostnqn, subnqn) = (k.s("hostnqn"), k.s("subnqn"));
    for name in ["tls.32.00", "tls.32.01", "tls.48.02", "tls.48.00"] {
        let v = |n: &str| k.s(&format!("{name}.{n}"));
        let h = |n: &str| k.hex(&format!("{name}.{n}"));
        let psk = ConfiguredPsk::parse(v("interchange")).unwrap();
        assert_eq!(psk.to_interchange(), v("interchange"), "{name}");
        assert_eq!(psk.retained(hostnqn).expose(), h("retained"), "{name}");
        let v0 = psk.tls_psk(0, hostnqn, subnqn).unwrap();
        assert_eq!(v0.identity, v("identity0"), "{name}");
        assert_eq!(v0.key.expose(), h("tls_psk0"), "{name}");
        let v1 = psk.tls_psk(1, hostnqn, subnqn).unwrap();
        assert_eq!(v1.identity, v("identity1"), "{name}");
        assert!(v1.identity.ends_with(v("digest")));
        assert_eq!(v1.key.expose(), h("tls_psk1"), "{name}");
        let configured = ConfiguredPsk::new(Secret::new(h("configured")), None).unwrap();
        assert_eq!(configured.retained("any").expose(), h("configured"));
    }
}
