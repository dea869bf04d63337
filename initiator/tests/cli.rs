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
    assert!(err.contains("LBA Out of Range"), "{err}");

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
