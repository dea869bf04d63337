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

fn bench(dir: &Path, t: &Target, extra: &[&str]) -> Output {
    let job = dir.join("job.toml");
    std::fs::write(&job, JOB).unwrap();
    Command::new(env!("CARGO_BIN_EXE_nvmeof-bench"))
        .arg(&job)
        .arg("--modes")
        .arg(format!("tcp={}", t.addr))
        .args(["--nqn", NQN, "--quiet"])
        .args(extra)
        .stdin(Stdio::null())
        .output()
        .expect("run nvmeof-bench")
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

    // Without a host NQN the target refuses the load generator's own one.
    let o = bench(dir.path(), &t, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(row(&o).contains("Connect Invalid Host"), "{}", text(&o));

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
