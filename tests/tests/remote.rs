//! The remote control API of a real `nvmeof-targetd` (`[target.remote_control]`), used with
//! `nvmeof-targetd ctl --remote`: mutual TLS refusals (no client certificate, another CA, an
//! identity not allowed, a read-only identity asking for a change, a target certificate the
//! client does not trust), and retries that change nothing twice.

use std::path::PathBuf;
use std::process::{Command, Output};

use nvmeof_tests::pki::{issue, new_ca};
use nvmeof_tests::{TargetProcess, bin_path, free_port};
use serde_json::Value;

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:remote";

struct Remote {
    _target: TargetProcess,
    dir: tempfile::TempDir,
    addr: String,
    socket: PathBuf,
}

impl Remote {
    fn start() -> Remote {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ca = new_ca("test CA");
        std::fs::write(d.join("ca.pem"), ca.cert.to_pem().unwrap()).unwrap();
        issue(d, "target", "target", &ca);
        issue(d, "admin", "admin", &ca);
        issue(d, "reader", "monitoring", &ca);
        issue(d, "stranger", "stranger", &ca);
        // The same names under another CA.
        let other = new_ca("other CA");
        std::fs::write(d.join("other-ca.pem"), other.cert.to_pem().unwrap()).unwrap();
        issue(d, "forged", "admin", &other);

        let (port, remote) = (free_port(), free_port());
        let p = |f: &str| d.join(f).display().to_string();
        let config = format!(
            "[target.remote_control]\nlisten = \"127.0.0.1:{remote}\"\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\nadmins = [\"admin\"]\nreaders = [\"monitoring\"]\n\n\
             [[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\n\
             [[subsystem.namespace]]\nbackend = \"null:1M\"\n",
            p("target.pem"),
            p("target.key"),
            p("ca.pem"),
        );
        let path = d.join("target.toml");
        std::fs::write(&path, config).unwrap();
        let socket = d.join("ctl.sock");
        let (c, s) = (path.display().to_string(), socket.display().to_string());
        let target = TargetProcess::spawn(&["--config", &c, "--control-socket", &s], port);
        Remote {
            _target: target,
            dir,
            addr: format!("127.0.0.1:{remote}"),
            socket,
        }
    }

    /// `ctl -o json --remote` as the client `who` (`NAME` of its files; "" for none), trusting
    /// the CA in `ca`.
    fn ctl(&self, who: &str, ca: &str, args: &[&str]) -> Output {
        let d = self.dir.path();
        let mut cmd = Command::new(bin_path("nvmeof-targetd"));
        cmd.args(["ctl", "-o", "json", "--remote", &self.addr, "--ca"])
            .arg(d.join(ca));
        if !who.is_empty() {
            cmd.arg("--cert")
                .arg(d.join(format!("{who}.pem")))
                .arg("--key")
                .arg(d.join(format!("{who}.key")));
        }
        cmd.args(args).output().expect("run nvmeof-targetd ctl")
    }

    fn ok(&self, who: &str, args: &[&str]) -> Value {
        let out = self.ctl(who, "ca.pem", args);
        assert!(
            out.status.success(),
            "{who} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("JSON answer")
    }

    /// The one line a refused `ctl` prints.
    fn refused(&self, who: &str, ca: &str, args: &[&str]) -> String {
        let out = self.ctl(who, ca, args);
        assert!(!out.status.success(), "{who} {args:?} succeeded");
        let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
        if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
            text.push_str(v["error"].as_str().unwrap_or_default());
        }
        text
    }

    /// The NSIDs the local control socket lists.
    fn nsids(&self) -> Vec<u64> {
        let out = Command::new(bin_path("nvmeof-targetd"))
            .args(["ctl", "-o", "json", "--socket"])
            .arg(&self.socket)
            .arg("list")
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["status"]["subsystems"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["nqn"] == NQN)
            .flat_map(|s| s["namespaces"].as_array().unwrap().clone())
            .map(|n| n["nsid"].as_u64().unwrap())
            .collect()
    }
}

const ADD: &[&str] = &[
    "add-namespace",
    "--subsystem",
    NQN,
    "--backend",
    "null:2M",
    "--nsid",
    "2",
];

#[test]
fn an_admin_changes_the_target_and_a_retry_changes_nothing_twice() {
    let r = Remote::start();
    let first = r.ok("admin", ADD);
    assert_eq!(first["ok"], true, "{first}");
    let lines = first["changes"].as_array().unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.as_str().unwrap().contains("added namespace 2")),
        "{first}"
    );
    // The answer was lost, the client asks again: nothing more happens.
    let again = r.ok("admin", ADD);
    assert_eq!(again["changes"], serde_json::json!([]), "{again}");
    assert_eq!(r.nsids(), vec![1, 2]);
    // Another namespace under the same NSID is still refused.
    let mut other = ADD.to_vec();
    other[4] = "null:4M";
    let e = r.refused("admin", "ca.pem", &other);
    assert!(e.contains("already has namespace 2"), "{e}");
    let sub = [
        "add-subsystem",
        "--nqn",
        "nqn.2026-11.io.nvmeof-direct:remote2",
        "--allow-any-host",
    ];
    assert_eq!(r.ok("admin", &sub)["changes"].as_array().unwrap().len(), 1);
    assert_eq!(r.ok("admin", &sub)["changes"], serde_json::json!([]));
    let rm = ["remove-namespace", "--subsystem", NQN, "--nsid", "2"];
    assert_eq!(r.ok("admin", &rm)["changes"].as_array().unwrap().len(), 1);
    assert_eq!(r.ok("admin", &rm)["changes"], serde_json::json!([]));
    assert_eq!(r.nsids(), vec![1]);
}

#[test]
fn clients_without_the_right_certificate_or_role_are_refused() {
    let r = Remote::start();
    // A reader reads, and may not change anything.
    let list = r.ok("reader", &["list"]);
    assert_eq!(list["ok"], true);
    let e = r.refused("reader", "ca.pem", ADD);
    assert!(e.contains("may only read"), "{e}");
    // A certificate of the right CA whose name is on no list.
    let e = r.refused("stranger", "ca.pem", &["list"]);
    assert!(e.contains("\"stranger\" is not allowed"), "{e}");
    // No client certificate, or one of another CA with an allowed name: no TLS session.
    for who in ["", "forged"] {
        let e = r.refused(who, "ca.pem", ADD);
        assert!(
            e.contains("the target ended the TLS session") || e.contains("TLS handshake failed"),
            "{who}: {e}"
        );
    }
    // The client does not trust a target certificate of another CA.
    let e = r.refused("admin", "other-ca.pem", ADD);
    assert!(e.contains("TLS handshake failed"), "{e}");
    // Bad input gets one error.
    let e = r.refused(
        "admin",
        "ca.pem",
        &[
            "resize-namespace",
            "--subsystem",
            NQN,
            "--nsid",
            "1",
            "--size",
            "lots",
        ],
    );
    assert!(!e.trim().is_empty(), "{e}");
    assert_eq!(r.nsids(), vec![1], "nothing changed");
}
