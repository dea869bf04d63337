//! A test certificate authority: certificates made in the test, for the remote control
//! API's mutual TLS.

use std::path::Path;

use openssl::asn1::Asn1Time;
use openssl::bn::{BigNum, MsbOption};
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::x509::extension::{BasicConstraints, KeyUsage, SubjectAlternativeName};
use openssl::x509::{X509, X509NameBuilder};

/// A CA: its certificate and key.
pub struct Ca {
    /// Its self-signed certificate.
    pub cert: X509,
    key: PKey<Private>,
}

fn key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap()
}

/// A certificate of `cn` for `key`, signed by `ca` (self-signed, as a CA, without one);
/// signed ones name 127.0.0.1 and 10.0.2.2 (the host as a QEMU guest sees it).
fn certificate(cn: &str, key: &PKey<Private>, ca: Option<&Ca>) -> X509 {
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_nid(Nid::COMMONNAME, cn).unwrap();
    let name = name.build();
    let mut b = X509::builder().unwrap();
    b.set_version(2).unwrap();
    let mut serial = BigNum::new().unwrap();
    serial.rand(64, MsbOption::MAYBE_ZERO, false).unwrap();
    b.set_serial_number(&serial.to_asn1_integer().unwrap())
        .unwrap();
    b.set_subject_name(&name).unwrap();
    b.set_pubkey(key).unwrap();
    b.set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    b.set_not_after(&Asn1Time::days_from_now(2).unwrap())
        .unwrap();
    match ca {
        None => {
            b.set_issuer_name(&name).unwrap();
            let bc = BasicConstraints::new().critical().ca().build().unwrap();
            b.append_extension(bc).unwrap();
            let ku = KeyUsage::new().critical().key_cert_sign().build().unwrap();
            b.append_extension(ku).unwrap();
            b.sign(key, MessageDigest::sha256()).unwrap();
        }
        Some(ca) => {
            b.set_issuer_name(ca.cert.subject_name()).unwrap();
            let san = SubjectAlternativeName::new()
                .ip("127.0.0.1")
                .ip("10.0.2.2")
                .build(&b.x509v3_context(Some(&ca.cert), None))
                .unwrap();
            b.append_extension(san).unwrap();
            b.sign(&ca.key, MessageDigest::sha256()).unwrap();
        }
    }
    b.build()
}

/// A new CA named `cn`.
pub fn new_ca(cn: &str) -> Ca {
    let key = key();
    Ca {
        cert: certificate(cn, &key, None),
        key,
    }
}

/// Writes `NAME.pem` and `NAME.key` in `dir` for `cn`, signed by `ca`.
pub fn issue(dir: &Path, name: &str, cn: &str, ca: &Ca) {
    let k = key();
    let cert = certificate(cn, &k, Some(ca));
    std::fs::write(dir.join(format!("{name}.pem")), cert.to_pem().unwrap()).unwrap();
    std::fs::write(
        dir.join(format!("{name}.key")),
        k.private_key_to_pem_pkcs8().unwrap(),
    )
    .unwrap();
}
