//! `nvmeof-bench` against a real `nvmeof-targetd` process given by address, as a user runs it:
//! read jobs leave the target's data alone unless asked to prefill, and a host NQN can be given
//! for targets that allow only listed hosts.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:bench-remote";
const HOSTNQN: &str = "nqn.2026-11.io.nvmeof-direct:host-allowed";
const SIZE: usize = 4 << 20;

const JOB: &str = r#"
[global]
runtime = "300ms"
verify = true

[[job]]
name = "rr"
rw = "randread"
bs = "4k"
iodepth = 4
"#;

fn targetd() -> PathBuf {
    let bin = nvmeof_bench::fabric::default_target_bin();
    bin.expect("nvmeof-targetd is not built: run `cargo build --workspace --bins` first")
}

/// `nvmeof-targetd` serving one file namespace to `HOSTNQN` only.
struct Target {
    child: Child,
    addr: SocketAddr,
}

impl Target {
    fn start(file: &Path) -> Target {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut child = Command::new(targetd())
            .arg("--listen")
            .arg(format!("tcp://{addr}"))
            .args(["--subsystem", NQN, "--host", HOSTNQN, "--reactors", "1"])
            .arg("--namespace")
            .arg(format!("file:{},direct=off", file.display()))
            .env("NVMEOF_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nvmeof-targetd");
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(child.try_wait().unwrap().is_none(), "nvmeof-targetd exited");
            assert!(Instant::now() < deadline, "nvmeof-targetd is not listening");
            std::thread::sleep(Duration::from_millis(20));
        }
        Target { child, addr }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the load generator against `t`, its host identity kept in `dir/state` (where the
/// `nvmeof` CLI keeps it when /etc/nvme/hostnqn is absent).
fn bench(dir: &Path, t: &Target, extra: &[&str]) -> Output {
    let job = dir.join("job.toml");
    std::fs::write(&job, JOB).unwrap();
    Command::new(env!("CARGO_BIN_EXE_nvmeof-bench"))
        .arg(&job)
        .arg("--modes")
        .arg(format!("tcp={}", t.addr))
        .args(["--nqn", NQN, "--quiet"])
        .args(extra)
        .env("NVMEOF_STATE_DIR", dir.join("state"))
        .stdin(Stdio::null())
        .output()
        .expect("run nvmeof-bench")
}

/// Whether this machine has a system host NQN, which wins over the state directory's.
fn etc_nvme_hostnqn() -> bool {
    Path::new("/etc/nvme/hostnqn").exists()
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The table row of the one point.
fn row(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .find(|l| l.starts_with("| randread"))
        .unwrap_or_else(|| panic!("no result row:\n{}", text(o)))
        .to_string()
}

#[test]
fn read_jobs_leave_a_target_at_an_address_unchanged_and_hostnqn_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("ns.img");
    // Data that is not the load generator's pattern.
    let data: Vec<u8> = (0..SIZE)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
        .collect();
    std::fs::write(&img, &data).unwrap();
    let t = Target::start(&img);

    // Without a host NQN the load generator connects as the nvmeof CLI would (here a host
    // NQN generated into the state directory), which the target refuses: the answer names
    // the host NQN and where it came from.
    let o = bench(dir.path(), &t, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let r = row(&o);
    assert!(r.contains("Connect Invalid Host"), "{}", text(&o));
    assert!(r.contains("does not allow host nqn."), "{r}");
    assert!(r.contains("--hostnqn"), "{r}");
    if !etc_nvme_hostnqn() {
        let stored = std::fs::read_to_string(dir.path().join("state/hostnqn")).unwrap();
        assert!(
            r.contains(&format!(
                "host {} (from {})",
                stored.trim(),
                dir.path().join("state/hostnqn").display()
            )),
            "{r}"
        );
    }

    // A read job: runs, verifies nothing, writes nothing.
    let o = bench(dir.path(), &t, &["--hostnqn", HOSTNQN]);
    assert!(o.status.success(), "{}", text(&o));
    let r = row(&o);
    assert!(r.ends_with("| off |"), "{r}");
    assert!(text(&o).contains("only after a prefill"), "{}", text(&o));
    assert!(!text(&o).contains("writes to the target"), "{}", text(&o));
    assert!(
        std::fs::read(&img).unwrap() == data,
        "a read job changed the target's data"
    );
    // --no-verify changes nothing of that.
    let o = bench(dir.path(), &t, &["--hostnqn", HOSTNQN, "--no-verify"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::read(&img).unwrap() == data);

    // Asked to prefill, it writes the pattern first and then verifies every read.
    let o = bench(dir.path(), &t, &["--hostnqn", HOSTNQN, "--prefill"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("writes to the target"), "{}", text(&o));
    let r = row(&o);
    assert!(r.ends_with(" ok |"), "{r}");
    assert!(std::fs::read(&img).unwrap() != data);
}

/// The host NQN the `nvmeof` CLI uses (/etc/nvme/hostnqn, else the state directory's) is the
/// load generator's too: an allow-listed host connects without --hostnqn.
#[test]
fn the_cli_host_identity_is_used_without_hostnqn() {
    if etc_nvme_hostnqn() {
        println!("SKIP the_cli_host_identity_is_used_without_hostnqn: /etc/nvme/hostnqn exists");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("ns.img");
    std::fs::write(&img, vec![0u8; SIZE]).unwrap();
    std::fs::create_dir(dir.path().join("state")).unwrap();
    std::fs::write(dir.path().join("state/hostnqn"), format!("{HOSTNQN}\n")).unwrap();
    let t = Target::start(&img);
    let o = bench(dir.path(), &t, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(row(&o).ends_with("| off |"), "{}", text(&o));
}
