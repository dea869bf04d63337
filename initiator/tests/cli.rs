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
        "-s",
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

    let mut a = args(&["connect", "-o", "json", "-i", "2", "-g"]);
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
        "--block-count",
        "16",
        "--data",
    ]);
    a.push(output.display().to_string());
    a.extend(fabric(&t));
    let v = json_of(&cli(a, None).await);
    assert_eq!(v["operation"], "read");
    assert_eq!(v["start_block"], 10);
    assert!(std::fs::read(&output).unwrap() == data);

    let mut a = args(&["read", "--start-block", "12", "--block-count", "2"]);
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
    let mut a = args(&["connect"]);
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

    let mut a = args(&["read", "--start-block", "300", "--block-count", "1"]);
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
        args(&["read", "data0", "--start-block", "0", "--block-count", "8"]),
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
        "-s",
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
    let mut a = args(&["read", "--block-count", "100000000"]);
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
    let mut a = args(&["read", "--start-block", "250", "--block-count", "7"]);
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
    let mut a = args(&[
        "write",
        "--block-count",
        "3",
        "--data",
        two.to_str().unwrap(),
    ]);
    a.extend(fabric_of(port));
    let out = cli(a, None).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("the input has 8192 bytes"));

    // A read that works replaces the file whole and leaves no temporary file.
    let mut a = args(&["read", "--block-count", "256"]);
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

    let mut a = args(&["connect"]);
    a.extend(fabric_of(closed));
    let out = cli(a, None).await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
    assert_eq!(err.matches("cannot connect to").count(), 1, "{err}");

    let mut a = args(&[
        "read",
        "--block-count",
        "1",
        "--data",
        "/nonexistent/dir/out.bin",
    ]);
    a.extend(fabric_of(t.addr.port()));
    let out = cli(a, None).await;
    let err = stderr_of(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");

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
    let out = cli(args(&["connect", "-a", "127.0.0.1"]), None).await;
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
    let mut a = args(&["read", "--block-count", "4096", "--reconnect-delay", "1"]);
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
    let mut a = args(&["read", "--block-count", "4096", "--ctrl-loss-tmo", "1"]);
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
        args(&["read", "secure", "--start-block", "0", "--block-count", "1"]),
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
        args(&["read", "secure", "--start-block", "0", "--block-count", "1"]),
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
