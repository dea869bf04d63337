//! `nvmeof discover --referrals` against the Linux kernel NVMe/TCP target (nvmet) in a QEMU
//! guest: two ports whose discovery logs refer to each other (configfs `ports/N/referrals/`),
//! reached through two forwarded ports; each discovery controller is read once.
//!
//! Needs the guest prepared by `tests/interop/setup.sh` and `NVMEOF_INTEROP=1`.

use std::process::Command;

use nvmeof_tests::{
    BackgroundGuest, TEST_HOSTNQN, bin_path, free_port, guest_sh, skip_without_interop,
    workspace_root,
};
use serde_json::Value;

const NQN_A: &str = "nqn.2014-08.org.nvmexpress:nvmeof-direct-referral-a";
const NQN_B: &str = "nqn.2014-08.org.nvmexpress:nvmeof-direct-referral-b";

#[test]
fn initiator_follows_the_kernel_targets_referrals_once_each() {
    if skip_without_interop() {
        return;
    }
    let (fa, fb) = (free_port(), free_port());
    let mut cmd = Command::new(guest_sh());
    cmd.args(["start", "--ready-marker", "NVMET-READY", "--timeout", "300"])
        .args(["--hostfwd", &format!("{fa}:4420")])
        .args(["--hostfwd", &format!("{fb}:4421")]);
    for env in [
        format!("NQN_A={NQN_A}"),
        format!("NQN_B={NQN_B}"),
        format!("FWD_A={fa}"),
        format!("FWD_B={fb}"),
    ] {
        cmd.arg("--env").arg(env);
    }
    cmd.arg(workspace_root().join("tests/guest/nvmet-referrals-target.sh"));
    let mut guest = BackgroundGuest::start(&mut cmd);

    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = Command::new(bin_path("nvmeof"))
        .args(["-o", "json", "discover", "-a", "127.0.0.1", "-s"])
        .arg(fa.to_string())
        .args(["--hostnqn", TEST_HOSTNQN, "--timeout", "30", "--referrals"])
        .arg("--state-dir")
        .arg(state.path())
        .output()
        .expect("run nvmeof");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let code = guest.stop();
    assert!(
        out.status.success(),
        "nvmeof discover --referrals: {stdout}{stderr}\nguest:\n{}",
        guest.console()
    );
    assert_eq!(code, Some(0), "{}", guest.console());
    let v: Value = serde_json::from_str(&stdout).unwrap();
    let ctrls = v["controllers"].as_array().unwrap();
    let read: Vec<(String, u64)> = ctrls
        .iter()
        .map(|c| {
            (
                c["trsvcid"].as_str().unwrap().to_string(),
                c["depth"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(read, vec![(fa.to_string(), 0), (fb.to_string(), 1)], "{v}");
    for (c, nqn, refers) in [(&ctrls[0], NQN_A, fb), (&ctrls[1], NQN_B, fa)] {
        let records = c["records"].as_array().unwrap();
        let has = |subtype: &str, f: &dyn Fn(&Value) -> bool| {
            records.iter().any(|r| r["subtype"] == subtype && f(r))
        };
        assert!(has("nvme subsystem", &|r| r["subnqn"] == nqn), "{c}");
        assert!(
            has("discovery subsystem referral", &|r| {
                r["traddr"] == "127.0.0.1" && r["trsvcid"].as_str() == Some(&refers.to_string())
            }),
            "{c}"
        );
    }
}
