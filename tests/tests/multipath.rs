//! Many paths and many hosts with real `nvmeof-targetd` processes and raw hosts: two target
//! processes exporting one namespace identity over one shared file (an active/standby pair
//! with disjoint controller IDs), ANA states set in the configuration and with
//! `ctl set-ana-state`, and a namespace masked from hosts not listed.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use nvme_spec::command::{build, cns, log_id};
use nvme_spec::identify::{CMIC_ANA, IdentifyController};
use nvme_spec::log::{AnaState, decode_ana_log};
use nvme_spec::status::{generic, path, sct};
use nvme_spec::{Cqe, FabricsCommand, FromBytes, SglDescriptor, Sqe, Status};
use nvmeof_tests::{RawHost, Reply, TEST_HOSTNQN, TargetProcess, bin_path, free_port};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:pair";
const OTHER_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000b2";

/// One target of a pair: its directory (config file and control socket) and process.
struct Node {
    target: TargetProcess,
    dir: tempfile::TempDir,
    toml: String,
}

impl Node {
    /// Starts a target on a free port from `body` (the text after the `[target]` table and
    /// the listener: its subsystems).
    fn start(listener_extra: &str, body: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let toml = format!(
            "[target]\nreactors = 1\ncontrol_socket = \"{}/ctl.sock\"\n\n[[listener]]\naddress = \
             \"tcp://127.0.0.1:{port}\"\n{listener_extra}\n{body}",
            dir.path().display()
        );
        let target = TargetProcess::with_config(dir.path(), &toml, 0o600, port);
        Node { target, dir, toml }
    }

    /// Kills the process (SIGKILL) and starts it again from the same configuration file.
    fn crash_and_restart(self) -> Node {
        let Node { target, dir, toml } = self;
        let port = target.port;
        target.crash();
        let path = dir.path().join("target.toml");
        let target = TargetProcess::spawn(&["--config", path.to_str().unwrap()], port);
        Node { target, dir, toml }
    }

    fn addr(&self) -> SocketAddr {
        self.target.addr()
    }

    /// `nvmeof-targetd ctl ARGS`: its standard output, or its standard error when refused.
    fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(bin_path("nvmeof-targetd"))
            .arg("ctl")
            .arg("--socket")
            .arg(self.dir.path().join("ctl.sock"))
            .args(args)
            .output()
            .expect("run nvmeof-targetd ctl");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        if out.status.success() {
            Ok(text(&out.stdout))
        } else {
            Err(text(&out.stderr))
        }
    }
}

/// A host's controller on one target: its admin queue and I/O queue 1.
struct Path2 {
    admin: RawHost,
    io: RawHost,
    cntlid: u16,
}

fn connect(addr: SocketAddr, hostnqn: &str) -> Path2 {
    let mut admin = RawHost::connect(addr, false, false);
    let c = admin.fabrics_connect(NQN, hostnqn, 0, 0xFFFF);
    assert!(c.status().is_success(), "admin Connect: {}", c.status());
    let cntlid = c.dw0.get() as u16;
    let cc = FabricsCommand::PropertySet {
        size8: false,
        offset: nvme_spec::fabrics::property::CC,
        value: u64::from(nvme_spec::fabrics::Cc::enable_value()),
    }
    .encode(2);
    assert!(complete(&mut admin, &cc).status().is_success());
    let nq = build::set_features(3, nvme_spec::features::NUMBER_OF_QUEUES, 0);
    assert!(complete(&mut admin, &nq).status().is_success());
    let mut io = RawHost::connect(addr, false, false);
    let c = io.fabrics_connect(NQN, hostnqn, 1, cntlid);
    assert!(c.status().is_success(), "I/O Connect: {}", c.status());
    Path2 { admin, io, cntlid }
}

fn complete(h: &mut RawHost, sqe: &Sqe) -> Cqe {
    match h.command(sqe, &[], &[]) {
        Reply::Completion(c, _) => c,
        other => panic!("{other:?}"),
    }
}

/// A 4 KiB admin answer, or its status.
fn admin_data(h: &mut RawHost, sqe: &Sqe) -> Result<Vec<u8>, Status> {
    let mut sqe = *sqe;
    sqe.dptr = SglDescriptor::tcp_transport(4096);
    match h.command(&sqe, &[], &[]) {
        Reply::Completion(c, d) if c.status().is_success() => Ok(d),
        Reply::Completion(c, _) => Err(c.status()),
        other => panic!("{other:?}"),
    }
}

fn write(h: &mut RawHost, nsid: u32, slba: u64, data: &[u8]) -> Status {
    let mut w = build::read_write(true, 5, nsid, slba, (data.len() / 4096) as u32);
    w.dptr = SglDescriptor::in_capsule(data.len() as u32);
    match h.command(&w, data, &[]) {
        Reply::Completion(c, _) => c.status(),
        other => panic!("write: {other:?}"),
    }
}

fn read(h: &mut RawHost, nsid: u32, slba: u64, len: usize) -> Result<Vec<u8>, Status> {
    let mut r = build::read_write(false, 6, nsid, slba, (len / 4096) as u32);
    r.dptr = SglDescriptor::tcp_transport(len as u32);
    match h.command(&r, &[], &[]) {
        Reply::Completion(c, d) if c.status().is_success() => Ok(d),
        Reply::Completion(c, _) => Err(c.status()),
        Reply::DataSuccess(d) => Ok(d),
        other => panic!("read: {other:?}"),
    }
}

fn ana_log(p: &mut Path2) -> Vec<(u32, AnaState, Vec<u32>)> {
    let page = admin_data(
        &mut p.admin,
        &build::get_log_page(7, log_id::ANA, 0, 4096, 0),
    )
    .expect("ANA log page");
    let (_, groups) = decode_ana_log(&page).expect("a well-formed ANA log page");
    groups
        .into_iter()
        .map(|g| (g.grpid, g.state, g.nsids))
        .collect()
}

fn pair_subsystem(file: &Path, cntlids: (u16, u16)) -> String {
    format!(
        "[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\ncntlid_min = {}\ncntlid_max = \
         {}\n\n[[subsystem.namespace]]\nbackend = \"file:{},size=4M,shared=on\"\n",
        cntlids.0,
        cntlids.1,
        file.display()
    )
}

fn path_status(sc: u8) -> Status {
    Status {
        sct: sct::PATH,
        sc,
        ..Default::default()
    }
}

/// Two processes serve one file as one namespace: the same identity on both paths,
/// controller IDs from disjoint ranges, the standby's path non-optimized by configuration.
/// The active path made inaccessible with `ctl set-ana-state` refuses I/O with the ANA
/// status while the standby serves it; the standby killed and restarted serves the same data.
#[test]
fn an_active_standby_pair_serves_one_namespace_through_path_changes() {
    let shared = tempfile::tempdir().unwrap();
    let file = shared.path().join("ns.img");
    let active = Node::start("", &pair_subsystem(&file, (1, 99)));
    let standby = Node::start(
        "ana = [{ group = 1, state = \"non-optimized\" }]",
        &pair_subsystem(&file, (100, 199)),
    );
    let mut a = connect(active.addr(), TEST_HOSTNQN);
    let mut b = connect(standby.addr(), TEST_HOSTNQN);
    assert!((1..=99).contains(&a.cntlid), "{}", a.cntlid);
    assert!((100..=199).contains(&b.cntlid), "{}", b.cntlid);

    // One namespace identity: serial, NGUID, UUID and EUI-64 are the same on both paths.
    let ident = |p: &mut Path2| {
        let c = admin_data(&mut p.admin, &build::identify(8, cns::CONTROLLER, 0)).unwrap();
        let c = IdentifyController::read_from_bytes(&c).unwrap();
        assert_ne!(c.cmic & CMIC_ANA, 0, "ANA reporting");
        let d = admin_data(&mut p.admin, &build::identify(9, cns::NS_DESCRIPTORS, 1)).unwrap();
        (c.sn, d)
    };
    assert_eq!(ident(&mut a), ident(&mut b));
    assert_eq!(ana_log(&mut a), vec![(1, AnaState::Optimized, vec![1])]);
    assert_eq!(ana_log(&mut b), vec![(1, AnaState::NonOptimized, vec![1])]);

    // Written through one path, read through the other.
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 7 % 251) as u8).collect();
    assert!(write(&mut a.io, 1, 3, &data).is_success());
    assert_eq!(read(&mut b.io, 1, 3, 8192).unwrap(), data);

    // The active path goes inaccessible: its I/O is refused with the path status (the host
    // may retry elsewhere), the standby's serves.
    let listener = format!("tcp://{}", active.addr());
    let out = active
        .ctl(&[
            "set-ana-state",
            "--listener",
            &listener,
            "--state",
            "inaccessible",
        ])
        .unwrap();
    assert!(out.contains("ANA group 1 is now inaccessible"), "{out}");
    let st = read(&mut a.io, 1, 3, 4096).unwrap_err();
    assert_eq!(st, path_status(path::ANA_INACCESSIBLE));
    assert!(!st.dnr);
    assert_eq!(ana_log(&mut a), vec![(1, AnaState::Inaccessible, vec![1])]);
    assert!(write(&mut b.io, 1, 5, &data[..4096]).is_success());
    let list = active.ctl(&["list"]).unwrap();
    assert!(
        list.contains(&format!("ANA group 1 on {listener}: inaccessible")),
        "{list}"
    );
    let e = active
        .ctl(&[
            "set-ana-state",
            "--listener",
            &listener,
            "--state",
            "asleep",
        ])
        .unwrap_err();
    assert!(e.contains("unknown ANA state"), "{e}");

    // The standby crashes and comes back on the same file: the data is there, and its
    // controllers still come from its range.
    drop(b);
    let standby = standby.crash_and_restart();
    let mut b = connect(standby.addr(), TEST_HOSTNQN);
    assert!((100..=199).contains(&b.cntlid), "{}", b.cntlid);
    assert_eq!(read(&mut b.io, 1, 3, 8192).unwrap(), data);
    assert_eq!(read(&mut b.io, 1, 5, 4096).unwrap(), &data[..4096]);
    // Back to optimized on the active path.
    active
        .ctl(&[
            "set-ana-state",
            "--listener",
            &listener,
            "--state",
            "optimized",
        ])
        .unwrap();
    assert_eq!(read(&mut a.io, 1, 5, 4096).unwrap(), &data[..4096]);
    drop((a, b));
    let _ = (active.target.terminate(), standby.target.terminate());
}

/// A namespace listed for one host is inactive for the others: not in the active namespace
/// list, a zeroed Identify Namespace, Invalid Namespace for I/O, until `ctl ns-add-host`.
#[test]
fn a_masked_namespace_is_hidden_from_hosts_not_listed() {
    let node = Node::start(
        "",
        &format!(
            "[[subsystem]]\nnqn = \"{NQN}\"\nallow_any_host = true\n\n[[subsystem.namespace]]\n\
             backend = \"mem:1M\"\n\n[[subsystem.namespace]]\nbackend = \"mem:1M\"\nhosts = \
             [\"{TEST_HOSTNQN}\"]\n"
        ),
    );
    let active = |p: &mut Path2| -> Vec<u32> {
        let list = admin_data(&mut p.admin, &build::identify(1, cns::ACTIVE_NS_LIST, 0)).unwrap();
        list.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .take_while(|&n| n != 0)
            .collect()
    };
    let mut listed = connect(node.addr(), TEST_HOSTNQN);
    let mut other = connect(node.addr(), OTHER_HOST);
    assert_eq!(active(&mut listed), vec![1, 2]);
    assert_eq!(active(&mut other), vec![1]);
    let id = admin_data(&mut other.admin, &build::identify(2, cns::NAMESPACE, 2)).unwrap();
    assert!(id.iter().all(|&b| b == 0), "inactive: zero-filled");
    let invalid_ns = Status::generic(generic::INVALID_NAMESPACE).with_dnr();
    assert_eq!(read(&mut other.io, 2, 0, 4096), Err(invalid_ns));
    assert!(read(&mut listed.io, 2, 0, 4096).is_ok());
    let list = node.ctl(&["list"]).unwrap();
    assert!(
        list.contains(&format!("seen by {TEST_HOSTNQN} only")),
        "{list}"
    );

    let out = node
        .ctl(&[
            "ns-add-host",
            "--subsystem",
            NQN,
            "--nsid",
            "2",
            "--host",
            OTHER_HOST,
        ])
        .unwrap();
    assert!(out.contains("namespace 2 is now seen by"), "{out}");
    assert_eq!(active(&mut other), vec![1, 2]);
    assert!(read(&mut other.io, 2, 0, 4096).is_ok());
    node.ctl(&[
        "ns-remove-host",
        "--subsystem",
        NQN,
        "--nsid",
        "2",
        "--host",
        TEST_HOSTNQN,
    ])
    .unwrap();
    assert_eq!(read(&mut listed.io, 2, 0, 4096), Err(invalid_ns));
    assert_eq!(active(&mut listed), vec![1]);
    let e = node
        .ctl(&[
            "ns-remove-host",
            "--subsystem",
            NQN,
            "--nsid",
            "2",
            "--host",
            OTHER_HOST,
        ])
        .unwrap_err();
    assert!(e.contains("last host"), "{e}");
    // The change was written back to the configuration file.
    let saved = std::fs::read_to_string(node.dir.path().join("target.toml")).unwrap();
    assert!(saved.contains(OTHER_HOST), "{saved}");
    assert!(!node.toml.contains(OTHER_HOST));
    drop((listed, other));
    let _ = node.target.terminate();
}
