//! Against nvme-cli, the tool Linux users make their keys with: its DH-HMAC-CHAP key
//! generation and transformation (`nvme gen-dhchap-key`, libnvme with OpenSSL) and its TLS PSK
//! interchange check (`nvme check-tls-key`).
//!
//! nvme-cli comes with the interop setup (`tests/interop/setup.sh`); with `NVMEOF_INTEROP=1`
//! a missing `nvme` is an error, otherwise these tests say they were skipped.

use std::process::Command;

use nvme_auth::tls::ConfiguredPsk;
use nvme_auth::{DhchapKey, HashId, Secret};

const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:7e5d3c1b-0000-4000-8000-00000000beef";

/// Runs `nvme ARGS`, or `None` when nvme-cli is absent and not required.
fn nvme(args: &[&str]) -> Option<String> {
    match Command::new("nvme").args(args).output() {
        Ok(out) => {
            assert!(
                out.status.success(),
                "nvme {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Some(String::from_utf8_lossy(&out.stdout).into_owned())
        }
        Err(e) => {
            assert!(
                std::env::var("NVMEOF_INTEROP").as_deref() != Ok("1"),
                "NVMEOF_INTEROP=1 but nvme-cli cannot run: {e}"
            );
            eprintln!("skipped: nvme-cli not installed ({e})");
            None
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn gen_dhchap_key_transforms_as_we_do() {
    // (nvme-cli 2.3 wants the key length to match the hash; the kernel accepts any mix.)
    for (len, hmac) in [(32, 0u8), (32, 1), (48, 2), (64, 3)] {
        let secret: Vec<u8> = (0..len)
            .map(|i| (i * 13 + usize::from(hmac)) as u8)
            .collect();
        let Some(out) = nvme(&[
            "gen-dhchap-key",
            &format!("--secret={}", hex(&secret)),
            &format!("--key-length={len}"),
            &format!("--hmac={hmac}"),
            &format!("--nqn={HOSTNQN}"),
        ]) else {
            return;
        };
        // nvme-cli prints the key already transformed for the NQN, marked with the hash.
        let theirs = DhchapKey::parse(out.trim()).expect("nvme-cli's key parses");
        let ours = DhchapKey::new(Secret::new(secret), HashId::from_u8(hmac)).unwrap();
        assert_eq!(
            theirs.transform_hash(),
            ours.transform_hash(),
            "{len} {hmac}"
        );
        assert_eq!(
            theirs.secret().expose(),
            ours.transformed(HOSTNQN).expose(),
            "length {len}, hmac {hmac}"
        );
    }
    // A random key of nvme-cli's making passes our CRC check and re-encodes identically.
    if let Some(out) = nvme(&["gen-dhchap-key", "--key-length=48"]) {
        assert_eq!(DhchapKey::parse(out.trim()).unwrap().to_dhhc1(), out.trim());
    }
}

#[test]
fn check_tls_key_accepts_our_interchange_strings() {
    // (nvme-cli 2.3 refuses the hash field 00 of an untransformed PSK, so only 01 and 02.)
    for (len, hash) in [(32, Some(HashId::Sha256)), (48, Some(HashId::Sha384))] {
        let psk: Vec<u8> = (0..len).map(|i| (i * 31 + 5) as u8).collect();
        let crc = crc32fast::hash(&psk);
        let ours = ConfiguredPsk::new(Secret::new(psk), hash)
            .unwrap()
            .to_interchange();
        let Some(out) = nvme(&["check-tls-key", &format!("--key={ours}")]) else {
            return;
        };
        assert!(out.contains("Key is valid"), "{out}");
        assert!(
            out.contains(&format!("length {len}, CRC {crc:08x}")),
            "{out}"
        );
    }
}
