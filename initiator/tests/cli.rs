//! The `nvmeof` CLI and the `nvmeof-initd` daemon as real processes against an in-process
//! target.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::time::Duration;

use common::cli::{Daemon, args, cli, json_of, list};
use common::{HOSTNQN, NQN, TestTarget, pattern};

const HOSTID: &str = "6f1e8a52-1c1b-4c57-9a0e-3f2d9d1e0b11";

fn fabric(t: &TestTarget) -> Vec<String> {
    args(&[
        "-t",
        "tcp",
        "-a",
        "127.0.0.1",
        "--trsvcid",
        &t.addr.port().to_string(),
        "-n",
        NQN,
        "--hostnqn",
        HOSTNQN,
        "--hostid",
        HOSTID,
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_commands_print_parseable_json() {
    let t = TestTarget::start(&["mem:8M"], |_| {});
    let port = t.addr.port();

    let mut a = args(&["discover", "-o", "json"]);
    a.extend(fabric(&t));
    let v = json_of(&cli(a, None).await);
    let rec = v["records"]
        .as_array()
        .expect("records")
        .iter()
        .find(|r| r["subnqn"] == NQN)
        .expect("subsystem record")
        .clone();
    assert_eq!(rec["trtype"], "tcp");
    assert_eq!(rec["trsvcid"], port.to_string());
    assert_eq!(rec["traddr"], "127.0.0.1");
    assert_eq!(rec["subtype"], "nvme subsystem");
    assert!(v["genctr"].as_u64().is_some());

    let mut a = args(&["probe", "-o", "json", "-i", "2", "-g"]);
    a.extend(fabric(&t));
    let v = json_of(&cli(a, None).await);
    assert_eq!(v["controller"]["subnqn"], NQN);
    assert_eq!(v["controller"]["io_queues"], 2);
    assert_eq!(v["controller"]["header_digest"], true);
    assert_eq!(v["controller"]["hostnqn"], HOSTNQN);
    assert_eq!(v["controller"]["model"], "nvmeof-direct");
    assert_eq!(v["namespaces"][0]["nsid"], 1);
    assert_eq!(v["namespaces"][0]["block_size"], 4096);
    assert_eq!(v["namespaces"][0]["blocks"], 2048);
    assert_eq!(v["namespaces"][0]["size_bytes"], 8 << 20);

    let mut a = args(&["id-ctrl", "-o", "json"]);
    a.extend(fabric(&t));
    let v = json_of(&cli(a, None).await);
    assert_eq!(v["subnqn"], NQN);
    assert_eq!(v["mn"], "nvmeof-direct");
    assert_eq!(v["cntrltype"], 1);
    assert!(v["cntlid"].as_u64().unwrap() > 0);

    let mut a = args(&["id-ns", "-o", "json", "--namespace-id", "1"]);
    a.extend(fabric(&t));
    let v = json_of(&cli(a, None).await);
    assert_eq!(v["nsze"], 2048);
    assert_eq!(v["block_size"], 4096);
    assert_eq!(v["lbafs"][0]["ds"], 12);

    // Write a file, read it back into another file and to stdout.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.bin");
    let data = pattern(42, 0, 16 * 4096);
    std::fs::write(&input, &data).unwrap();
    let mut a = args(&[
        "write",
        "-o",
        "json",
        "--start-block",
        "10",
        "--flush",
        "--data",
    ]);
    a.push(input.display().to_string());
    a.extend(fabric(&t));
    let v = json_of(&cli(a, None).await);
    assert_eq!(v["operation"], "write");
    assert_eq!(v["blocks"], 16);
    assert_eq!(v["bytes"], 65536);

    let output = dir.path().join("out.bin");
    let mut a = args(&[
        "read",
        "-o",
        "json",
        "--start-block",
        "10",
        "--blocks",
        "16",
        "--data",
    ]);
    a.push(output.display().to_string());
    a.extend(fabric(&t));
    let v = json_of(&cli(a, None).await);
    assert_eq!(v["operation"], "read");
    assert_eq!(v["start_block"], 10);
    assert!(std::fs::read(&output).unwrap() == data);

    let mut a = args(&["read", "--start-block", "12", "--blocks", "2"]);
    a.extend(fabric(&t));
    let out = cli(a, None).await;
    assert!(out.status.success());
    assert!(out.stdout[..] == data[2 * 4096..4 * 4096]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("read: 2 blocks"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_errors_are_one_line_and_fail() {
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let mut a = args(&["probe"]);
    let mut f = fabric(&t);
    let i = f.iter().position(|x| x == NQN).unwrap();
    f[i] = "nqn.2026-11.io.nvmeof-direct:nope".into();
    a.extend(f);
    let out = cli(a, None).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("nvmeof: error: "), "{err}");
    assert!(err.contains("Connect Invalid Parameters"), "{err}");

    let mut a = args(&["read", "--start-block", "300", "--blocks", "1"]);
    a.extend(fabric(&t));
    let out = cli(a, None).await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("outside namespace 1"), "{err}");

    let out = cli(
        args(&["list"]),
        Some(PathBuf::from("/nonexistent/initd.sock")),
    )
    .await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is nvmeof-initd running?"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_attach_list_restart_detach() {
    let t = TestTarget::start(&["mem:8M", "mem:4M"], |_| {});
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/initd.sock");
    let state = dir.path().join("state");
    let d = Daemon::start(&socket, &state, &dir.path().join("initd1.log"));
    d.wait_ready().await;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);

    // Attach namespace 2 under a name.
    let mut a = args(&["attach", "data0", "-o", "json", "--namespace-id", "2"]);
    a.extend(fabric(&t));
    let v = json_of(&cli(a, Some(socket.clone())).await);
    assert_eq!(v["name"], "data0");
    assert_eq!(v["state"], "connected");
    assert_eq!(v["nsid"], 2);
    assert_eq!(v["size_bytes"], 4 << 20);

    // Attaching the same name again, or an unreachable target, fails and keeps nothing.
    let mut a = args(&["attach", "data0"]);
    a.extend(fabric(&t));
    let out = cli(a, Some(socket.clone())).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("exists already"));
    let mut a = args(&["attach", "bad", "--namespace-id", "9"]);
    a.extend(fabric(&t));
    let out = cli(a, Some(socket.clone())).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot attach bad"));

    let devices = list(&socket).await;
    assert_eq!(devices.len(), 1, "{devices:?}");
    let dev = &devices[0];
    assert_eq!(dev["name"], "data0");
    assert_eq!(dev["subsystem"], NQN);
    assert_eq!(dev["nsid"], 2);
    assert_eq!(dev["block_size"], 4096);
    assert_eq!(dev["blocks"], 1024);
    assert_eq!(dev["model"], "nvmeof-direct");
    assert_eq!(dev["state"], "connected");
    assert_eq!(dev["hostnqn"], HOSTNQN);

    // A program opens the attachment by name and does its own I/O.
    let ns = nvmeof_initiator::open_attached_at(&socket, "data0")
        .await
        .expect("open_attached");
    assert_eq!(ns.nsid(), 2);
    let data = pattern(77, 0, 8 * 4096);
    ns.write(0, &data).await.expect("write");
    ns.controller()
        .clone()
        .disconnect()
        .await
        .expect("disconnect");

    // The CLI reads by name too.
    let out = cli(
        args(&["read", "data0", "--start-block", "0", "--blocks", "8"]),
        Some(socket.clone()),
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout == data);

    // Restart: the attachment comes back.
    assert_eq!(d.terminate().await, Some(0));
    assert!(!socket.exists(), "socket left behind");
    let stored = std::fs::read_to_string(state.join("attachments.json")).unwrap();
    assert!(stored.contains("\"data0\""));
    let d2 = Daemon::start(&socket, &state, &dir.path().join("initd2.log"));
    d2.wait_ready().await;
    let mut state_now = String::new();
    for _ in 0..100 {
        let devices = list(&socket).await;
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0]["name"], "data0");
        state_now = devices[0]["state"].as_str().unwrap_or_default().to_string();
        if state_now == "connected" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state_now, "connected", "{}", d2.log());

    let out = cli(args(&["detach", "data0"]), Some(socket.clone())).await;
    assert!(out.status.success());
    assert!(list(&socket).await.is_empty());
    let stored = std::fs::read_to_string(state.join("attachments.json")).unwrap();
    assert!(!stored.contains("\"data0\""));
    assert_eq!(d2.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_reports_a_lost_target() {
    let mut t = TestTarget::start(&["mem:1M"], |_| {});
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("initd.sock");
    let d = Daemon::start(
        &socket,
        &dir.path().join("state"),
        &dir.path().join("initd.log"),
    );
    d.wait_ready().await;
    let mut a = args(&["attach", "x", "-o", "json"]);
    a.extend(fabric(&t));
    json_of(&cli(a, Some(socket.clone())).await);
    t.shutdown().await;
    let mut seen = String::new();
    for _ in 0..100 {
        let devices = list(&socket).await;
        seen = devices[0]["state"].as_str().unwrap_or_default().to_string();
        if seen == "reconnecting" {
            assert!(devices[0]["last_error"].as_str().is_some());
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seen, "reconnecting", "{}", d.log());
    assert_eq!(d.terminate().await, Some(0));
}

fn fabric_of(port: u16) -> Vec<String> {
    args(&[
        "-a",
        "127.0.0.1",
        "--trsvcid",
        &port.to_string(),
        "-n",
        NQN,
        "--hostnqn",
        HOSTNQN,
        "--hostid",
        HOSTID,
    ])
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Files in `dir` other than `keep`.
fn others_in(dir: &std::path::Path, keep: &[&str]) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_are_checked_before_any_transfer_and_output_appears_whole() {
    // 256 blocks of 4 KiB.
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let port = t.addr.port();
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("out.bin");
    std::fs::write(&out_file, b"earlier contents").unwrap();
    let data = pattern(5, 0, 256 * 4096);
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &data).unwrap();
    let mut a = args(&["write", "--data", input.to_str().unwrap()]);
    a.extend(fabric_of(port));
    assert!(cli(a, None).await.status.success());

    // A read past the end: usage error naming the size, nothing transferred or written.
    let mut a = args(&["read", "--blocks", "100000000"]);
    a.extend(["--data".into(), out_file.display().to_string()]);
    a.extend(fabric_of(port));
    let out = cli(a, None).await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("it has 256 blocks of 4096 bytes (1.00 MiB)"),
        "{err}"
    );
    assert_eq!(std::fs::read(&out_file).unwrap(), b"earlier contents");
    let mut a = args(&["read", "--start-block", "250", "--blocks", "7"]);
    a.extend(["--data".into(), out_file.display().to_string()]);
    a.extend(fabric_of(port));
    assert_eq!(cli(a, None).await.status.code(), Some(2));
    assert_eq!(std::fs::read(&out_file).unwrap(), b"earlier contents");
    assert!(others_in(dir.path(), &["out.bin", "in.bin"]).is_empty());

    // Writes past the end, or with less input than asked for, change nothing.
    let two = dir.path().join("two.bin");
    std::fs::write(&two, vec![0xAB; 2 * 4096]).unwrap();
    let mut a = args(&[
        "write",
        "--start-block",
        "255",
        "--data",
        two.to_str().unwrap(),
    ]);
    a.extend(fabric_of(port));
    let out = cli(a, None).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("outside namespace 1"));
    let mut a = args(&["write", "--blocks", "3", "--data", two.to_str().unwrap()]);
    a.extend(fabric_of(port));
    let out = cli(a, None).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("the input has 8192 bytes"));

    // A read that works replaces the file whole and leaves no temporary file.
    let mut a = args(&["read", "--blocks", "256"]);
    a.extend(["--data".into(), out_file.display().to_string()]);
    a.extend(fabric_of(port));
    let out = cli(a, None).await;
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        std::fs::read(&out_file).unwrap() == data,
        "the target changed"
    );
    assert!(others_in(dir.path(), &["out.bin", "in.bin", "two.bin"]).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_say_their_cause_once_with_distinct_exit_codes() {
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();

    let mut a = args(&["probe"]);
    a.extend(fabric_of(closed));
    let out = cli(a, None).await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
    assert_eq!(err.matches("cannot connect to").count(), 1, "{err}");

    let mut a = args(&[
        "read",
        "--blocks",
        "1",
        "--data",
        "/nonexistent/dir/out.bin",
    ]);
    a.extend(fabric_of(t.addr.port()));
    let out = cli(a, None).await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "cannot create /nonexistent/dir/out.bin: directory /nonexistent/dir does not exist"
        ),
        "{err}"
    );

    let out = cli(
        args(&["list"]),
        Some(PathBuf::from("/nonexistent/initd.sock")),
    )
    .await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(5), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert_eq!(err.matches("nvmeof-initd").count(), 2, "{err}");
    assert!(err.contains("tried /nonexistent/initd.sock"), "{err}");

    // The target answers with an error status: 4; a missing flag: 2.
    let mut a = args(&["id-ns", "--namespace-id", "9"]);
    a.extend(fabric_of(t.addr.port()));
    let out = cli(a, None).await;
    assert_eq!(out.status.code(), Some(4), "{}", stderr_of(&out));
    let out = cli(args(&["probe", "-a", "127.0.0.1"]), None).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("(-n NQN)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_reported_and_ctrl_loss_tmo_bounds_the_wait() {
    use std::sync::atomic::Ordering;
    let mut t = TestTarget::start(&["mem:16M"], |_| {});
    let dir = tempfile::tempdir().unwrap();
    let data = pattern(9, 0, 16 << 20);
    let input = dir.path().join("in.bin");
    std::fs::write(&input, &data).unwrap();
    let mut a = args(&["write", "--data", input.to_str().unwrap()]);
    a.extend(fabric_of(t.addr.port()));
    assert!(cli(a, None).await.status.success());

    // The connection is cut once, 4 MiB into a read: the CLI says so, reconnects, and the
    // data comes out whole.
    let proxy = common::Proxy::start(t.addr).await;
    proxy.cut_after.store(4 << 20, Ordering::SeqCst);
    let out_file = dir.path().join("out.bin");
    let mut a = args(&["read", "--blocks", "4096", "--reconnect-delay", "1"]);
    a.extend(["--data".into(), out_file.display().to_string()]);
    a.extend(fabric_of(proxy.addr.port()));
    let out = cli(a, None).await;
    let err = stderr_of(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("lost") && err.contains("reconnecting for up to 10 s (--ctrl-loss-tmo)"),
        "{err}"
    );
    assert!(err.contains("nvmeof: reconnected to 127.0.0.1:"), "{err}");
    assert!(std::fs::read(&out_file).unwrap() == data);

    // Cut again, and the target is gone: the CLI gives up after --ctrl-loss-tmo.
    std::fs::remove_file(&out_file).unwrap();
    proxy.to_host.store(0, Ordering::SeqCst);
    proxy.cut_after.store(4 << 20, Ordering::SeqCst);
    let mut a = args(&["read", "--blocks", "4096", "--ctrl-loss-tmo", "1"]);
    a.extend(["--data".into(), out_file.display().to_string()]);
    a.extend(fabric_of(proxy.addr.port()));
    let run = tokio::spawn(cli(a, None));
    while proxy.to_host.load(Ordering::SeqCst) < 4 << 20 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    t.shutdown().await;
    let out = run.await.unwrap();
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains("reconnecting for up to 1 s (--ctrl-loss-tmo)"),
        "{err}"
    );
    assert!(!out_file.exists());
    assert!(others_in(dir.path(), &["in.bin"]).is_empty());
}

/// `nvmeof` run as user nobody with these supplementary groups and `$XDG_RUNTIME_DIR`.
async fn cli_as_nobody(
    bin: PathBuf,
    groups: &'static str,
    xdg: PathBuf,
    a: Vec<String>,
) -> std::process::Output {
    tokio::task::spawn_blocking(move || {
        std::process::Command::new("setpriv")
            .args([
                "--reuid", "65534", "--regid", "65534", "--groups", groups, "--",
            ])
            .arg(bin)
            .args(a)
            .env_remove("NVMEOF_INITD_SOCKET")
            .env("XDG_RUNTIME_DIR", xdg)
            .env("HOME", "/nonexistent")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run setpriv")
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_in_the_group_finds_the_system_daemon() {
    if !nvmeof_initiator::identity::is_root() {
        eprintln!("skipped: needs root to run the system daemon and to switch users");
        return;
    }
    const GID: &str = "4242";
    let socket = PathBuf::from(nvmeof_initiator::daemon::DEFAULT_SOCKET);
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_err(),
        "a system nvmeof-initd runs already at {}",
        socket.display()
    );
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    // The user's own runtime directory, without a daemon of its own.
    let xdg = dir.path().join("xdg");
    std::fs::create_dir(&xdg).unwrap();
    // A copy of the CLI that user nobody may run wherever the build lives.
    let bin = dir.path().join("nvmeof");
    std::fs::copy(common::cli::nvmeof(), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();

    let state = dir.path().join("state");
    let d = Daemon::start_with(
        &socket,
        &state,
        &dir.path().join("initd.log"),
        &["--group", GID],
    );
    d.wait_ready().await;
    let mut a = args(&["attach", "data0"]);
    a.extend(fabric(&t));
    assert!(cli(a, Some(socket.clone())).await.status.success());

    // In the socket's group: the system daemon is found after the user's own socket.
    let out = cli_as_nobody(bin.clone(), GID, xdg.clone(), args(&["list", "-o", "json"])).await;
    let v = json_of(&out);
    assert_eq!(v["devices"][0]["name"], "data0", "{v}");
    assert_eq!(v["devices"][0]["trsvcid"], t.addr.port().to_string());

    // Not in it: the error names both sockets and why each failed.
    let out = cli_as_nobody(bin, "65534", xdg.clone(), args(&["list"])).await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(5), "{err}");
    assert!(
        err.contains(&format!(
            "{}: No such file",
            xdg.join("nvmeof/initd.sock").display()
        )),
        "{err}"
    );
    assert!(
        err.contains("/run/nvmeof/initd.sock: Permission denied")
            && err.contains("only root and the socket's group may use it"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(d.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_keeps_dhchap_secrets_root_only_and_never_lists_them() {
    let key = "DHHC-1:00:ZXhhbXBsZS1rZXktZm9yLXVuaXQtdGVzdHMtMzJieXR38mKy:";
    let listen = "tcp://127.0.0.1:0".parse().unwrap();
    let ns = ["mem:4M".parse().unwrap()];
    let mut cfg = nvmeof_target::Config::quick(&[listen], NQN, &ns, true, &[]).unwrap();
    cfg.subsystems[0].allow_any_host = false;
    cfg.target.reactors = 1;
    cfg.subsystems[0]
        .auth_hosts
        .push(nvmeof_target::config::HostAuthConfig {
            nqn: HOSTNQN.to_string(),
            dhchap_key: Some(nvme_auth::DhchapKey::parse(key).unwrap()),
            tls_psk: None,
            dhchap_ctrl_key: None,
            dhchap_hash: None,
            dhchap_dhgroup: None,
        });
    let t = TestTarget::from_config(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/initd.sock");
    let state = dir.path().join("state");
    let d = Daemon::start(&socket, &state, &dir.path().join("initd.log"));
    d.wait_ready().await;

    let mut a = args(&["attach", "nokey"]);
    a.extend(fabric(&t));
    let out = cli(a, Some(socket.clone())).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("authentication of queue 0 failed"),
        "{err}"
    );

    let mut a = args(&["attach", "secure", "-o", "json", "--dhchap-secret", key]);
    a.extend(fabric(&t));
    let out = cli(a, Some(socket.clone())).await;
    assert!(!String::from_utf8_lossy(&out.stdout).contains("DHHC-1"));
    assert_eq!(json_of(&out)["state"], "connected");
    let listed = list(&socket).await;
    assert!(!format!("{listed:?}").contains("DHHC-1"), "{listed:?}");
    let file = state.join("attachments.json");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert!(std::fs::read_to_string(&file).unwrap().contains(key));

    // A process opening the attachment authenticates with the stored secret.
    let out = cli(
        args(&["read", "secure", "--start-block", "0", "--blocks", "1"]),
        Some(socket.clone()),
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout.len(), 4096);
    assert!(!d.log().contains(&key[10..40]), "a key reached the log");
    assert_eq!(d.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_attaches_over_tls_and_keeps_the_psk_root_only() {
    let key = "NVMeTLSkey-1:01:BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwfLJNij:";
    let listen = "tcp://127.0.0.1:0".parse().unwrap();
    let ns = ["mem:4M".parse().unwrap()];
    let mut cfg = nvmeof_target::Config::quick(&[listen], NQN, &ns, true, &[]).unwrap();
    cfg.subsystems[0].allow_any_host = false;
    cfg.target.reactors = 1;
    cfg.listeners[0].tls = Some(nvmeof_target::config::TlsRequirement::Required);
    cfg.subsystems[0]
        .auth_hosts
        .push(nvmeof_target::config::HostAuthConfig {
            nqn: HOSTNQN.to_string(),
            dhchap_key: None,
            tls_psk: Some(nvme_auth::tls::ConfiguredPsk::parse(key).unwrap()),
            dhchap_ctrl_key: None,
            dhchap_hash: None,
            dhchap_dhgroup: None,
        });
    let t = TestTarget::from_config(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("run/initd.sock");
    let state = dir.path().join("state");
    let d = Daemon::start(&socket, &state, &dir.path().join("initd.log"));
    d.wait_ready().await;

    // Without the key the TLS listener does not let the attachment connect.
    let mut a = args(&["attach", "plain"]);
    a.extend(fabric(&t));
    let out = cli(a, Some(socket.clone())).await;
    assert!(!out.status.success(), "attached without TLS");

    let mut a = args(&["attach", "secure", "-o", "json", "--tls-key", key]);
    a.extend(fabric(&t));
    let out = cli(a, Some(socket.clone())).await;
    assert!(!String::from_utf8_lossy(&out.stdout).contains("NVMeTLSkey"));
    assert_eq!(json_of(&out)["state"], "connected");
    let listed = list(&socket).await;
    assert!(!format!("{listed:?}").contains("NVMeTLSkey"), "{listed:?}");
    let file = state.join("attachments.json");
    let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert!(std::fs::read_to_string(&file).unwrap().contains(key));

    // A process opening the attachment connects over TLS with the stored PSK.
    let out = cli(
        args(&["read", "secure", "--start-block", "0", "--blocks", "1"]),
        Some(socket.clone()),
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout.len(), 4096);
    assert!(!d.log().contains(&key[16..40]), "a key reached the log");
    assert_eq!(d.terminate().await, Some(0));
}

/// `nvmeof ARGS` through the daemon at `socket`, with the exit status and stderr checked.
async fn ok_through(socket: &std::path::Path, a: Vec<String>) -> std::process::Output {
    let out = cli(a.clone(), Some(socket.to_path_buf())).await;
    assert!(out.status.success(), "{a:?}: {}", stderr_of(&out));
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_and_write_refuse_nvme_cli_flags_that_mean_something_else() {
    // 256 blocks of 4 KiB.
    let t = TestTarget::start(&["mem:1M"], |_| {});
    let port = t.addr.port();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("initd.sock");
    let d = Daemon::start(
        &socket,
        &dir.path().join("state"),
        &dir.path().join("initd.log"),
    );
    d.wait_ready().await;
    let mut a = args(&["attach", "train0"]);
    a.extend(fabric(&t));
    ok_through(&socket, a).await;
    let z = dir.path().join("z.bin");
    std::fs::write(&z, pattern(3, 0, 4096)).unwrap();
    let zero = vec![0u8; 4096];
    let block = |lba: &str| {
        let socket = socket.clone();
        let lba = lba.to_string();
        async move {
            let out = ok_through(
                &socket,
                args(&["read", "train0", "--start-block", &lba, "--blocks", "1"]),
            )
            .await;
            out.stdout
        }
    };

    // nvme-cli's -s (first block) with an attachment name: refused, nothing written.
    let out = cli(
        args(&["write", "train0", "-s", "100", "-d", z.to_str().unwrap()]),
        Some(socket.clone()),
    )
    .await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--start-block 100"), "{err}");
    assert!(block("0").await == zero, "written at block 0");
    assert!(block("100").await == zero, "written at block 100");
    let out = cli(args(&["read", "train0", "-s", "100"]), Some(socket.clone())).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(out.stdout.is_empty());

    // nvme-cli's 0-based -c/--block-count: refused, with the count to give instead.
    for flag in ["-c", "--block-count"] {
        let out = cli(
            args(&["read", "train0", "--start-block", "3", flag, "7"]),
            Some(socket.clone()),
        )
        .await;
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("--blocks 8"), "{err}");
        assert!(out.stdout.is_empty());
    }

    // With -a, -s is refused too; the port is --trsvcid.
    let mut a = args(&["read", "--blocks", "1"]);
    a.extend(fabric(&t));
    let i = a.iter().position(|x| x == "--trsvcid").unwrap();
    a[i] = "-s".into();
    let out = cli(a, None).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("--trsvcid PORT"));

    // An attachment name brings its own target and host: other flags for them are refused.
    let port_s = port.to_string();
    for extra in [
        &["--trsvcid", port_s.as_str()][..],
        &["-t", "tcp"],
        &["--hostnqn", HOSTNQN],
    ] {
        let mut a = args(&["read", "train0", "--blocks", "1"]);
        a.extend(args(extra));
        let out = cli(a, Some(socket.clone())).await;
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains("give either the name or"), "{err}");
    }

    // The right flags: written at block 100, read back by --data-size (nvme-cli's -z).
    let out = ok_through(
        &socket,
        args(&[
            "write",
            "train0",
            "--start-block",
            "100",
            "-d",
            z.to_str().unwrap(),
        ]),
    )
    .await;
    let err = stderr_of(&out);
    assert!(
        err.starts_with("write: 1 block (4.00 KiB) at block 100 of namespace 1 in "),
        "{err}"
    );
    assert!(err.trim_end().ends_with("MB/s"), "{err}");
    let out = ok_through(
        &socket,
        args(&["read", "train0", "--start-block", "100", "-z", "4096"]),
    )
    .await;
    assert!(out.stdout == pattern(3, 0, 4096));
    assert!(block("0").await == zero);
    let out = cli(
        args(&["read", "train0", "--blocks", "2", "--data-size", "4096"]),
        Some(socket.clone()),
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    let out = cli(
        args(&["read", "train0", "--data-size", "5000"]),
        Some(socket.clone()),
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("not a multiple of the block size 4096"));
    assert_eq!(d.terminate().await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvme_cli_command_names_act_on_the_daemon() {
    let t = TestTarget::start(&["mem:1M", "mem:2M"], |_| {});
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("initd.sock");

    // Without a daemon, connect says so (it does not just probe the target).
    let mut a = args(&["connect"]);
    a.extend(fabric(&t));
    let out = cli(a, Some(socket.clone())).await;
    assert_eq!(out.status.code(), Some(5), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("is nvmeof-initd running?"));

    let d = Daemon::start(
        &socket,
        &dir.path().join("state"),
        &dir.path().join("initd.log"),
    );
    d.wait_ready().await;

    // connect: every namespace, named as nvme-cli names devices; again: nothing new.
    let mut a = args(&["connect", "-o", "json"]);
    a.extend(fabric(&t));
    let v = json_of(&ok_through(&socket, a.clone()).await);
    let names: Vec<&str> = v["attached"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["nvmeof0n1", "nvmeof0n2"], "{v}");
    assert_eq!(v["attached"][1]["size_bytes"], 2 << 20);
    let v = json_of(&ok_through(&socket, a).await);
    assert!(v["attached"].as_array().unwrap().is_empty(), "{v}");
    assert_eq!(v["already_attached"].as_array().unwrap().len(), 2, "{v}");

    // list-subsys groups the attachments by subsystem.
    let out = ok_through(&socket, args(&["list-subsys"])).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.starts_with(NQN), "{text}");
    assert!(text.contains("nvmeof0n1 tcp traddr=127.0.0.1"), "{text}");
    let v = json_of(&ok_through(&socket, args(&["list-subsys", "-o", "json"])).await);
    assert_eq!(v["subsystems"][0]["nqn"], NQN);
    assert_eq!(
        v["subsystems"][0]["attachments"].as_array().unwrap().len(),
        2
    );

    // disconnect -n NQN: every attachment of the subsystem.
    let out = ok_through(&socket, args(&["disconnect", "-n", NQN])).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "detached nvmeof0n1\ndetached nvmeof0n2\n"
    );
    assert!(list(&socket).await.is_empty());
    let out = cli(args(&["disconnect", "-n", NQN]), Some(socket.clone())).await;
    assert_eq!(out.status.code(), Some(5), "{}", stderr_of(&out));

    // connect one namespace under a name of one's own; disconnect -d NAME.
    let mut a = args(&["connect", "--namespace-id", "2", "--name", "data"]);
    a.extend(fabric(&t));
    let out = ok_through(&socket, a).await;
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("attached datan2 -> "));
    ok_through(&socket, args(&["disconnect", "-d", "datan2"])).await;
    assert!(list(&socket).await.is_empty());

    // connect-all from the discovery log (the I/O port answers discovery), disconnect-all.
    let out = ok_through(
        &socket,
        args(&[
            "connect-all",
            "-a",
            "127.0.0.1",
            "-s",
            &t.addr.port().to_string(),
            "--hostnqn",
            HOSTNQN,
            "--hostid",
            HOSTID,
        ]),
    )
    .await;
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("attached nvmeof0n2 -> "),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(list(&socket).await.len(), 2);
    let out = ok_through(&socket, args(&["disconnect-all"])).await;
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2);
    assert!(list(&socket).await.is_empty());
    let out = cli(args(&["disconnect"]), Some(socket.clone())).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("-n NQN"));
    assert_eq!(d.terminate().await, Some(0));
}

/// Waits (up to 10 s) until the daemon lists attachment `name` as `pred` accepts; returns
/// that entry.
async fn wait_listed(
    socket: &std::path::Path,
    name: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let mut last = serde_json::Value::Null;
    for _ in 0..100 {
        if let Some(a) = list(socket).await.into_iter().find(|a| a["name"] == name) {
            if pred(&a) {
                return a;
            }
            last = a;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{name} never reached the expected state: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn daemon_follows_namespace_resize_and_removal_on_the_target() {
    use nvmeof_target::control;
    use nvmeof_target::reconfigure::Registry;
    use nvmeof_target::{RunningTarget, Target};

    let listen = "tcp://127.0.0.1:0".parse().unwrap();
    // Null namespaces can be resized while served.
    let ns = ["mem:1M".parse().unwrap(), "null:2M".parse().unwrap()];
    let mut cfg = nvmeof_target::Config::quick(&[listen], NQN, &ns, true, &[]).unwrap();
    cfg.target.reactors = 1;
    let target = Target::build(&cfg).unwrap();
    let listeners = nvmeof_target::launcher::bind(&cfg).unwrap();
    let port = listeners[0].addr.addr.port();
    let registry = Registry::new(RunningTarget::start(target, listeners).unwrap(), cfg);
    // What `nvmeof-targetd ctl` sends.
    let ctl = |line: String| {
        let r = control::handle(&registry, &line);
        assert!(r.ok, "{line}: {:?}", r.error);
    };

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("initd.sock");
    let d = Daemon::start(
        &socket,
        &dir.path().join("state"),
        &dir.path().join("initd.log"),
    );
    d.wait_ready().await;
    for (name, nsid) in [("one", "1"), ("two", "2")] {
        let mut a = args(&["attach", name, "--namespace-id", nsid]);
        a.extend(fabric_of(port));
        ok_through(&socket, a).await;
    }

    // ctl resize-namespace: the new size is listed.
    ctl(format!(
        r#"{{"version":1,"op":"resize-namespace","subsystem":"{NQN}","nsid":2,"size":"4M"}}"#
    ));
    let two = wait_listed(&socket, "two", |a| a["size_bytes"] == 4 << 20).await;
    assert_eq!(two["blocks"], 1024);
    assert_eq!(two["state"], "connected");
    assert!(
        d.log().contains("resized from 2097152 to 4194304 bytes"),
        "{}",
        d.log()
    );

    // ctl remove-namespace: listed as removed, with why; the other attachment is untouched.
    ctl(format!(
        r#"{{"version":1,"op":"remove-namespace","subsystem":"{NQN}","nsid":1}}"#
    ));
    let one = wait_listed(&socket, "one", |a| a["state"] == "removed").await;
    assert_eq!(one["size_bytes"], serde_json::Value::Null);
    assert_eq!(
        one["last_error"],
        format!("namespace 1 was removed from {NQN}")
    );
    let out = ok_through(&socket, args(&["list"])).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.contains(&format!("removed (namespace 1 was removed from {NQN})")),
        "{text}"
    );
    let two = wait_listed(&socket, "two", |_| true).await;
    assert_eq!(two["state"], "connected");
    assert_eq!(two["size_bytes"], 4 << 20);
    let log = d.log();
    assert!(log.contains("namespace attribute changed"), "{log}");
    assert!(log.contains("namespace 1 was removed from"), "{log}");

    // Added back: connected again.
    ctl(format!(
        r#"{{"version":1,"op":"add-namespace","subsystem":"{NQN}","backend":"mem:1M","nsid":1}}"#
    ));
    wait_listed(&socket, "one", |a| {
        a["state"] == "connected" && a["size_bytes"] == 1 << 20
    })
    .await;
    assert_eq!(d.terminate().await, Some(0));
    registry.running().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connects_exit_alike_and_name_the_host() {
    let key = "DHHC-1:00:ZXhhbXBsZS1rZXktZm9yLXVuaXQtdGVzdHMtMzJieXR38mKy:";
    let listen = "tcp://127.0.0.1:0".parse().unwrap();
    let ns = ["mem:4M".parse().unwrap()];
    let mut cfg = nvmeof_target::Config::quick(&[listen], NQN, &ns, true, &[]).unwrap();
    cfg.subsystems[0].allow_any_host = false;
    cfg.target.reactors = 1;
    cfg.subsystems[0]
        .auth_hosts
        .push(nvmeof_target::config::HostAuthConfig {
            nqn: HOSTNQN.to_string(),
            dhchap_key: Some(nvme_auth::DhchapKey::parse(key).unwrap()),
            tls_psk: None,
            dhchap_ctrl_key: None,
            dhchap_hash: None,
            dhchap_dhgroup: None,
        });
    let t = TestTarget::from_config(&cfg);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("initd.sock");
    let d = Daemon::start(
        &socket,
        &dir.path().join("state"),
        &dir.path().join("initd.log"),
    );
    d.wait_ready().await;

    // Authentication fails: the same exit status through the daemon and directly.
    for verb in ["attach", "connect", "probe"] {
        let mut a = args(&[verb]);
        if verb == "attach" {
            a.push("nokey".into());
        }
        a.extend(fabric(&t));
        let out = cli(a, Some(socket.clone())).await;
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(3), "{verb}: {err}");
        assert!(err.contains("authentication of queue 0 failed"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }

    // A host the subsystem does not allow: the message names it, through the daemon too.
    let other = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-000000000001";
    for verb in ["probe", "attach"] {
        let mut a = args(&[verb]);
        if verb == "attach" {
            a.push("other".into());
        }
        let mut f = fabric(&t);
        let i = f.iter().position(|x| x == HOSTNQN).unwrap();
        f[i] = other.into();
        a.extend(f);
        let out = cli(a, Some(socket.clone())).await;
        let err = stderr_of(&out);
        assert_eq!(out.status.code(), Some(4), "{verb}: {err}");
        assert!(
            err.contains(&format!("does not allow host {other} on subsystem {NQN}")),
            "{err}"
        );
    }

    // A subsystem that is not there: said so.
    let mut a = args(&["probe"]);
    let mut f = fabric(&t);
    let i = f.iter().position(|x| x == NQN).unwrap();
    f[i] = "nqn.2026-11.io.nvmeof-direct:nope".into();
    a.extend(f);
    let out = cli(a, None).await;
    let err = stderr_of(&out);
    assert!(
        err.contains("subsystem nqn.2026-11.io.nvmeof-direct:nope is not on the target"),
        "{err}"
    );
    assert_eq!(d.terminate().await, Some(0));
}
