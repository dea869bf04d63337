//! mDNS between real processes: `nvmeof-targetd` with `[discovery] mdns = true` advertises
//! its discovery listener (`_nvme-disc._tcp`), `nvmeof discover --mdns` finds it and reads
//! its discovery log; a listener removed with `ctl` is no longer found.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nvmeof_tests::{TEST_HOSTNQN, TargetProcess, bin_path, ctl_ok, free_port};
use serde_json::Value;

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:mdns";

/// The discovery controllers `nvmeof discover --mdns` read: (port, their subsystem NQNs).
fn browse(state: &Path) -> Vec<(String, Vec<String>)> {
    let out = Command::new(bin_path("nvmeof"))
        .args(["-o", "json", "discover", "--mdns", "--mdns-wait", "2"])
        .args(["--hostnqn", TEST_HOSTNQN, "--state-dir"])
        .arg(state)
        .output()
        .expect("run nvmeof");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let Ok(v) = serde_json::from_str::<Value>(&stdout) else {
        // Nothing advertised (another test's target may be, or not).
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("no discovery controller answered"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return Vec::new();
    };
    v["controllers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let nqns = c["records"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["subnqn"].as_str().map(str::to_string))
                .collect();
            (c["trsvcid"].as_str().unwrap_or_default().to_string(), nqns)
        })
        .collect()
}

#[test]
fn the_discovery_listener_is_found_over_mdns_until_it_goes() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (port, dport) = (free_port(), free_port());
    let config = dir.path().join("target.toml");
    std::fs::write(
        &config,
        format!(
            "[[listener]]\naddress = \"tcp://0.0.0.0:{port}\"\n\n\
             [discovery]\nlisten = [\"tcp://0.0.0.0:{dport}\"]\nmdns = true\n\n\
             [[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\n\
             [[subsystem.namespace]]\nbackend = \"mem:1M\"\n"
        ),
    )
    .unwrap();
    let socket = dir.path().join("ctl.sock");
    let (c, s) = (config.display().to_string(), socket.display().to_string());
    let mut t = TargetProcess::spawn(&["--config", &c, "--control-socket", &s], port);
    let log = t.log();
    if log.contains("mDNS advertisement off") {
        eprintln!("skipped: no multicast here: {log}");
        return;
    }
    assert!(
        log.contains("advertising the discovery controller over mDNS"),
        "{log}"
    );
    let state = dir.path().join("cli");
    std::fs::create_dir(&state).unwrap();
    let mine = |found: &[(String, Vec<String>)]| {
        found
            .iter()
            .find(|(p, _)| *p == dport.to_string())
            .map(|(_, nqns)| nqns.clone())
    };
    let found = browse(&state);
    let nqns = mine(&found).unwrap_or_else(|| panic!("{found:?}\n{}", t.log()));
    assert!(nqns.contains(&NQN.to_string()), "{nqns:?}");

    // Removed, the listener is no longer advertised (the advertisement follows within a
    // second or so; the wait ends as soon as it did).
    let out = ctl_ok(
        &socket,
        &[
            "remove-listener",
            "--discovery",
            &format!("tcp://0.0.0.0:{dport}"),
        ],
    );
    assert!(out.contains("stopped listening"), "{out}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while mine(&browse(&state)).is_some() {
        assert!(Instant::now() < deadline, "still advertised:\n{}", t.log());
    }
    let (code, log) = t.terminate();
    assert_eq!(code, Some(0), "{log}");
}

/// Avahi in a QEMU guest (`guest.sh --with-avahi`) next to `nvmeof-targetd`: `avahi-browse`
/// resolves the advertisement with its TXT keys, `nvmeof discover --mdns` reads it, and Avahi
/// forgets it after the target's goodbye (tests/guest/mdns-avahi.sh). QEMU's user networking
/// carries no multicast between this machine and the guest, so all three run in the guest.
/// Needs `tests/interop/setup.sh --with-avahi` and `NVMEOF_INTEROP=1`.
#[test]
fn avahi_in_the_guest_sees_the_advertisement_and_its_goodbye() {
    if nvmeof_tests::skip_without_interop() {
        return;
    }
    let cache = std::env::var_os("INTEROP_CACHE").map_or_else(
        || nvmeof_tests::workspace_root().join("tests/interop/.cache"),
        std::path::PathBuf::from,
    );
    if !cache.join("initrd/avahi.cpio.zst").exists() {
        eprintln!("skipped: no Avahi in the guest (run tests/interop/setup.sh --with-avahi)");
        return;
    }
    let out = Command::new(nvmeof_tests::guest_sh())
        .args(["run", "--with-avahi", "--timeout", "300"])
        .arg("--add-bin")
        .arg(format!(
            "{}:/usr/bin/nvmeof-targetd",
            bin_path("nvmeof-targetd").display()
        ))
        .arg("--add-bin")
        .arg(format!("{}:/usr/bin/nvmeof", bin_path("nvmeof").display()))
        .arg(nvmeof_tests::workspace_root().join("tests/guest/mdns-avahi.sh"))
        .output()
        .expect("guest.sh");
    let console = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && console.contains("PASS: avahi sees the mDNS advertisement"),
        "guest failed ({:?}):\n{console}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
