//! The Linux kernel NVMe/TCP host (in a QEMU guest) against an `nvmeof-targetd` subsystem that
//! requires DH-HMAC-CHAP for some hosts.
//!
//! - Linux 6.12 (trixie's kernel and nvme-cli 2.13): one-way and two-way authentication with
//!   each hash (SHA-256/384/512) and the null, ffdhe2048 and ffdhe3072 groups, every queue
//!   authenticated, fio with verify on each; a re-authentication asked through sysfs; a wrong
//!   host key, no host key, a controller key the target does not have and a wrong controller
//!   key are refused, and the daemon keeps serving (an authenticated and a plain host after).
//! - Linux 6.1 (built without NVMe authentication): refused cleanly, and a plain host still
//!   served.
//!
//! Needs the guests prepared by `tests/interop/setup.sh --with-k612` and `NVMEOF_INTEROP=1`;
//! without it each test prints why it did nothing.

use std::process::Command;

use nvme_auth::{DhchapKey, HashId, Secret};
use nvmeof_tests::{
    TargetProcess, assert_console_has, free_port, guest_sh, run_guest, skip_without_interop,
    workspace_root,
};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:kernel-auth";
/// The guest's own host NQN, allowed without authentication.
const PLAIN: &str = "nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-0000000000b0";

/// A host with its keys and the hash and DH group the target restricts it to.
struct Host {
    nqn: String,
    hostid: String,
    key: String,
    ctrl: Option<String>,
    hash: &'static str,
    group: &'static str,
}

fn key(byte: u8, hash: HashId) -> String {
    DhchapKey::new(Secret::new(vec![byte; hash.digest_len()]), Some(hash))
        .unwrap()
        .to_dhhc1()
}

fn host(n: u8, ctrl: bool, hash: HashId, group: &'static str) -> Host {
    Host {
        nqn: format!("nqn.2014-08.org.nvmexpress:uuid:6a0f0c4e-0000-4000-8000-0000000000b{n}"),
        hostid: format!("6a0f0c4e-0000-4000-8000-0000000000c{n}"),
        key: key(n, hash),
        ctrl: ctrl.then(|| key(n + 0x10, HashId::Sha512)),
        hash: hash.name(),
        group,
    }
}

/// `NQN|HOSTID|KEY|CTRLKEY` for the guest script.
fn case(h: &Host, key: Option<&str>, ctrl: Option<&str>) -> String {
    format!(
        "{}|{}|{}|{}",
        h.nqn,
        h.hostid,
        key.unwrap_or("-"),
        ctrl.unwrap_or("-")
    )
}

fn start(dir: &std::path::Path, hosts: &[&Host]) -> TargetProcess {
    let port = free_port();
    let mut toml = format!(
        "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n[[subsystem]]\nnqn = \"{NQN}\"\n\
         hosts = [\"{PLAIN}\"]\n\n[[subsystem.namespace]]\nbackend = \"mem:64M\"\n"
    );
    for h in hosts {
        toml += &format!(
            "\n[[subsystem.host]]\nnqn = \"{}\"\ndhchap_key = \"{}\"\ndhchap_hash = \"{}\"\n\
             dhchap_dhgroup = \"{}\"\n",
            h.nqn, h.key, h.hash, h.group
        );
        if let Some(c) = &h.ctrl {
            toml += &format!("dhchap_ctrl_key = \"{c}\"\n");
        }
    }
    TargetProcess::with_config(dir, &toml, 0o600, port)
}

fn guest(kernel: &str, t: &TargetProcess, ok: &[String], refused: &[String]) -> String {
    let mut cmd = Command::new(guest_sh());
    cmd.args(["run", "--kernel", kernel, "--with-fio", "--timeout", "900"]);
    for env in [
        format!("TARGET_PORT={}", t.port),
        format!("TARGET_NQN={NQN}"),
        format!("GUEST_HOSTNQN={PLAIN}"),
        format!("AUTH_OK={}", ok.join(" ")),
        format!("AUTH_REFUSED={}", refused.join(" ")),
        "REAUTH=1".to_string(),
        "PLAIN=1".to_string(),
    ] {
        cmd.arg("--env").arg(env);
    }
    cmd.arg(workspace_root().join("tests/guest/kernel-host-auth.sh"));
    run_guest(&mut cmd)
}

/// The target's log lines that report a queue authenticated with `hash` and `group`.
fn authenticated(log: &str, hostnqn: &str, hash: &str, group: &str) -> usize {
    log.lines()
        .filter(|l| {
            l.contains("host authenticated")
                && l.contains(hostnqn)
                && l.contains(hash)
                && l.contains(&format!("dhgroup=\"{group}\""))
        })
        .count()
}

#[test]
fn kernel_612_host_authenticates_every_queue_and_is_refused_without_the_keys() {
    if skip_without_interop() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let one = host(1, false, HashId::Sha256, "null");
    let two = host(2, true, HashId::Sha384, "ffdhe2048");
    let three = host(3, true, HashId::Sha512, "ffdhe3072");
    let mut t = start(dir.path(), &[&one, &two, &three]);
    let wrong = key(0x7f, HashId::Sha256);
    let refused = [
        case(&one, Some(&wrong), None),
        case(&one, None, None),
        case(&one, Some(&one.key), two.ctrl.as_deref()),
        case(&two, Some(&two.key), Some(&wrong)),
    ];
    let ok = [
        case(&one, Some(&one.key), None),
        case(&two, Some(&two.key), two.ctrl.as_deref()),
        case(&three, Some(&three.key), three.ctrl.as_deref()),
    ];
    let console = guest("612", &t, &ok, &refused);
    assert_console_has(&console, &["REAUTH done", "PASS: kernel host DH-HMAC-CHAP"]);
    let log = t.log();
    // Admin and two I/O queues each, and the re-authentication of the first host's queues.
    assert!(
        authenticated(&log, &one.nqn, one.hash, one.group) > 3,
        "{log}"
    );
    for h in [&two, &three] {
        assert!(authenticated(&log, &h.nqn, h.hash, h.group) >= 3, "{log}");
    }
    assert!(log.contains("bidirectional=true"), "{log}");
    assert!(
        log.matches("host authentication failed").count() >= 2,
        "{log}"
    );
    for k in [&one.key, &two.key, &wrong] {
        assert!(!log.contains(&k[10..40]), "a key reached the log");
    }
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}

#[test]
fn kernel_61_host_without_authentication_is_refused_cleanly() {
    if skip_without_interop() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let one = host(1, false, HashId::Sha256, "ffdhe2048");
    let mut t = start(dir.path(), &[&one]);
    let refused = [case(&one, None, None)];
    let console = guest("61", &t, &[], &refused);
    assert_console_has(
        &console,
        &["refused as expected", "PASS: kernel host DH-HMAC-CHAP"],
    );
    let log = t.log();
    assert!(!log.contains("host authenticated"), "{log}");
    assert!(log.contains("controller connected"), "{log}");
    let (code, _) = t.terminate();
    assert_eq!(code, Some(0));
}
