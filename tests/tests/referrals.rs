//! Discovery referrals between real `nvmeof-targetd` processes: the referral entries of the
//! discovery log, changed live by `ctl` and by a SIGHUP reload, and `nvmeof discover
//! --referrals` reading every discovery controller once, however the referrals loop.

use std::path::{Path, PathBuf};
use std::process::Command;

use nvmeof_tests::{TEST_HOSTNQN, TargetProcess, bin_path, ctl_ok, free_port};
use serde_json::Value;

const A: &str = "nqn.2026-11.io.nvmeof-direct:referrals-a";
const B: &str = "nqn.2026-11.io.nvmeof-direct:referrals-b";

/// A target with one subsystem on `port`, referring to `referrals`, controlled through a
/// socket in `dir`.
fn start(dir: &Path, nqn: &str, port: u16, referrals: &[u16]) -> (TargetProcess, PathBuf) {
    let refs: Vec<String> = referrals
        .iter()
        .map(|p| format!("\"tcp://127.0.0.1:{p}\""))
        .collect();
    let config = dir.join("target.toml");
    std::fs::write(
        &config,
        format!(
            "[[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n\n\
             [discovery]\nreferrals = [{}]\n\n\
             [[subsystem]]\nnqn = \"{nqn}\"\nallow_any_host = true\n\n\
             [[subsystem.namespace]]\nbackend = \"mem:1M\"\n",
            refs.join(", ")
        ),
    )
    .unwrap();
    let socket = dir.join("ctl.sock");
    let (c, s) = (config.display().to_string(), socket.display().to_string());
    let t = TargetProcess::spawn(&["--config", &c, "--control-socket", &s], port);
    (t, socket)
}

/// `nvmeof -o json discover` at `port` with `args`; its JSON output.
fn discover(port: u16, args: &[&str], state: &Path) -> Value {
    let out = Command::new(bin_path("nvmeof"))
        .args(["-o", "json", "discover", "-a", "127.0.0.1", "-s"])
        .arg(port.to_string())
        .args(["--hostnqn", TEST_HOSTNQN, "--state-dir"])
        .arg(state)
        .args(args)
        .output()
        .expect("run nvmeof");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "nvmeof discover {args:?}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// The (subtype, traddr:trsvcid, subnqn) of each record of one log.
fn records(log: &Value) -> Vec<(String, String, String)> {
    log["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
            (
                s("subtype"),
                format!("{}:{}", s("traddr"), s("trsvcid")),
                s("subnqn"),
            )
        })
        .collect()
}

fn referrals_of(log: &Value) -> Vec<String> {
    records(log)
        .into_iter()
        .filter(|(t, _, _)| t == "discovery subsystem referral")
        .map(|(_, a, nqn)| {
            assert_eq!(nqn, "nqn.2014-08.org.nvmexpress.discovery");
            a
        })
        .collect()
}

fn subsystems_of(log: &Value) -> Vec<String> {
    records(log)
        .into_iter()
        .filter(|(t, _, _)| t == "nvme subsystem")
        .map(|(_, _, nqn)| nqn)
        .collect()
}

#[test]
fn referrals_are_listed_changed_live_and_followed_once_each() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (da, db) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir(&da).unwrap();
    std::fs::create_dir(&db).unwrap();
    let state = dir.path().join("cli");
    std::fs::create_dir(&state).unwrap();
    let (pa, pb) = (free_port(), free_port());
    // A refers to B and B back to A: a loop.
    let (mut ta, sa) = start(&da, A, pa, &[pb]);
    let (tb, _sb) = start(&db, B, pb, &[pa]);
    let b_addr = format!("127.0.0.1:{pb}");

    let log = discover(pa, &[], &state);
    assert_eq!(referrals_of(&log), vec![b_addr.clone()], "{log}");
    assert_eq!(subsystems_of(&log), vec![A.to_string()]);

    // Following the referrals reads A, then B, once each, though B refers back to A.
    let walk = discover(pa, &["--referrals"], &state);
    let ctrls = walk["controllers"].as_array().unwrap();
    let seen: Vec<(String, u64)> = ctrls
        .iter()
        .map(|c| {
            (
                c["trsvcid"].as_str().unwrap().to_string(),
                c["depth"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![(pa.to_string(), 0), (pb.to_string(), 1)],
        "{walk}"
    );
    assert_eq!(subsystems_of(&ctrls[1]), vec![B.to_string()]);
    // --max-depth 0: the first controller only.
    let walk = discover(pa, &["--referrals", "--max-depth", "0"], &state);
    assert_eq!(walk["controllers"].as_array().unwrap().len(), 1, "{walk}");

    // ctl takes the referral out and puts another in; the log follows at once.
    let out = ctl_ok(&sa, &["remove-referral", &format!("tcp://{b_addr}")]);
    assert!(out.contains("no longer refers to"), "{out}");
    assert!(referrals_of(&discover(pa, &[], &state)).is_empty());
    ctl_ok(&sa, &["add-referral", "tcp://192.0.2.7:8009"]);
    let list = ctl_ok(&sa, &["list"]);
    assert!(list.contains("referrals: tcp://192.0.2.7:8009"), "{list}");
    assert_eq!(
        referrals_of(&discover(pa, &[], &state)),
        vec!["192.0.2.7:8009".to_string()]
    );
    // Twice, or a bad address: refused in one line.
    let twice = Command::new(bin_path("nvmeof-targetd"))
        .args(["ctl", "--socket"])
        .arg(&sa)
        .args(["add-referral", "tcp://192.0.2.7:8009"])
        .output()
        .unwrap();
    assert!(!twice.status.success());
    assert!(
        String::from_utf8_lossy(&twice.stderr).contains("exists already"),
        "{twice:?}"
    );

    // ctl kept the change in the configuration file; a SIGHUP reload of an edited file
    // replaces the referral.
    let file = da.join("target.toml");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains("tcp://192.0.2.7:8009"), "{text}");
    std::fs::write(
        &file,
        text.replace("tcp://192.0.2.7:8009", &format!("tcp://{b_addr}")),
    )
    .unwrap();
    ta.signal(libc::SIGHUP);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while referrals_of(&discover(pa, &[], &state)) != vec![b_addr.clone()] {
        assert!(std::time::Instant::now() < deadline, "{}", ta.log());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    // A referred controller that is gone: reported, the others still printed.
    let (code, log) = tb.terminate();
    assert_eq!(code, Some(0), "{log}");
    let out = Command::new(bin_path("nvmeof"))
        .args(["discover", "-a", "127.0.0.1", "-s"])
        .arg(pa.to_string())
        .args(["--hostnqn", TEST_HOSTNQN, "--state-dir"])
        .arg(&state)
        .args(["--referrals", "--timeout", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains(A), "{stdout}");
    assert!(
        stderr.contains(&format!("discovery at {b_addr} (referral level 1) failed")),
        "{stderr}"
    );
    let (code, log) = ta.terminate();
    assert_eq!(code, Some(0), "{log}");
}
