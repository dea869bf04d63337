//! The CSI driver `nvmeof-csi` against real `nvmeof-targetd` storage nodes with their remote
//! control API (mutual TLS): the Identity and Controller services over gRPC on a Unix
//! socket, each step checked against the target's own `ctl list`; a target restarting while
//! a CreateVolume waits for it, and a CreateVolume completing what a failed one left; and
//! `csi-sanity` (the CSI conformance suite) when it is installed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nvmeof_csi::controller::{NO_HOST, NQN_PREFIX, key_of};
use nvmeof_csi::grpc::{Client, Code, Status};
use nvmeof_csi::proto::*;
use nvmeof_tests::pki::{issue, new_ca};
use nvmeof_tests::{TargetProcess, bin_path, ctl_ok, free_port};
use serde_json::Value;

const HOST1: &str = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-1111-1111-111111111111";
const HOST2: &str = "nqn.2014-08.org.nvmexpress:uuid:22222222-2222-2222-2222-222222222222";
const M: i64 = 1 << 20;

/// One storage node: a target with remote control on, and its local control socket.
struct Store {
    target: Option<TargetProcess>,
    name: String,
    config: PathBuf,
    socket: PathBuf,
    port: u16,
    remote: u16,
}

impl Store {
    fn start(dir: &Path, name: &str) -> Store {
        let (port, remote) = (free_port(), free_port());
        let p = |f: &str| dir.join(f).display().to_string();
        let toml = format!(
            "[target.remote_control]\nlisten = \"127.0.0.1:{remote}\"\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\nadmins = [\"csi\"]\n\n\
             [[listener]]\naddress = \"tcp://127.0.0.1:{port}\"\n",
            p("target.pem"),
            p("target.key"),
            p("ca.pem"),
        );
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, toml).unwrap();
        let mut s = Store {
            target: None,
            name: name.into(),
            config,
            socket: dir.join(format!("{name}.sock")),
            port,
            remote,
        };
        s.run();
        s
    }

    fn run(&mut self) {
        let (c, s) = (
            self.config.display().to_string(),
            self.socket.display().to_string(),
        );
        self.target = Some(TargetProcess::spawn(
            &["--config", &c, "--control-socket", &s],
            self.port,
        ));
    }

    /// This driver's subsystems as `ctl list` shows them: (NQN, allowed hosts, namespace sizes).
    fn volumes(&self) -> Vec<(String, Vec<String>, Vec<u64>)> {
        let out = ctl_ok(&self.socket, &["-o", "json", "list"]);
        let v: Value = serde_json::from_str(&out).unwrap();
        let mut all: Vec<_> = v["status"]["subsystems"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["nqn"].as_str().unwrap().starts_with(NQN_PREFIX))
            .map(|s| {
                let hosts = s["hosts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|h| h.as_str().unwrap().to_string())
                    .filter(|h| h != NO_HOST)
                    .collect();
                let sizes = s["namespaces"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n["size"].as_u64().unwrap())
                    .collect();
                (s["nqn"].as_str().unwrap().to_string(), hosts, sizes)
            })
            .collect();
        all.sort();
        all
    }

    /// Its `[[storage_node]]` entry; its file volumes go to a folder beside its config.
    fn entry(&self, pool: &str, capacity: &str) -> String {
        let files = self.config.with_extension("files");
        std::fs::create_dir_all(&files).unwrap();
        format!(
            "[[storage_node]]\nname = \"{}\"\ncontrol = \"127.0.0.1:{}\"\naddress = \"127.0.0.1\"\nport = {}\npool = \"{pool}\"\ncapacity = \"{capacity}\"\nfile_dir = \"{}\"\n\n",
            self.name,
            self.remote,
            self.port,
            files.display()
        )
    }
}

/// A running `nvmeof-csi`, its log in a file.
struct Csi {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    rt: tokio::runtime::Runtime,
}

impl Csi {
    /// Starts the driver with Controller (storage nodes `nodes`, TOML entries) and Node
    /// services.
    fn start(dir: &Path, nodes: &str) -> Csi {
        let p = |f: &str| dir.join(f).display().to_string();
        let cfg = format!(
            "retry_seconds = 60\n[tls]\nca = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\n\n{nodes}",
            p("ca.pem"),
            p("csi.pem"),
            p("csi.key")
        );
        std::fs::write(dir.join("csi.toml"), cfg).unwrap();
        let socket = dir.join("csi.sock");
        let log = dir.join("csi.log");
        let child = Command::new(bin_path("nvmeof-csi"))
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .arg("--controller-config")
            .arg(dir.join("csi.toml"))
            .args(["--node", "--host-nqn", HOST1])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start nvmeof-csi");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            assert!(
                Instant::now() < deadline,
                "nvmeof-csi did not start: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Csi {
            child,
            socket,
            log,
            rt,
        }
    }

    fn call<Q: prost::Message, R: prost::Message + Default>(
        &self,
        path: &str,
        req: &Q,
    ) -> Result<R, Status> {
        self.rt.block_on(async {
            let mut c = Client::connect(&self.socket).await?;
            c.call(path, req).await
        })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Csi {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A directory with the CA, the targets' certificate and the driver's client certificate.
fn pki() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let ca = new_ca("csi test CA");
    std::fs::write(dir.path().join("ca.pem"), ca.cert.to_pem().unwrap()).unwrap();
    issue(dir.path(), "target", "target", &ca);
    issue(dir.path(), "csi", "csi", &ca);
    dir
}

fn mount_cap() -> VolumeCapability {
    VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
        })),
        access_mode: Some(AccessMode {
            mode: MODE_SINGLE_NODE_WRITER,
        }),
    }
}

fn create(name: &str, bytes: i64, params: &[(&str, &str)]) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap()],
        parameters: params
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    }
}

fn volume(r: CreateVolumeResponse) -> Volume {
    r.volume.expect("a volume")
}

fn code<T: std::fmt::Debug>(r: Result<T, Status>) -> Code {
    r.expect_err("the call should fail").code
}

#[test]
fn controller_makes_publishes_grows_and_deletes_volumes_on_a_pool_of_storage_nodes() {
    let dir = pki();
    let a = Store::start(dir.path(), "store-a");
    let b = Store::start(dir.path(), "store-b");
    let csi = Csi::start(
        dir.path(),
        &format!("{}{}", a.entry("fast", "48M"), b.entry("default", "64M")),
    );

    let info: GetPluginInfoResponse = csi
        .call("/csi.v1.Identity/GetPluginInfo", &GetPluginInfoRequest {})
        .unwrap();
    assert_eq!(info.name, nvmeof_csi::DRIVER_NAME);
    let probe: ProbeResponse = csi
        .call("/csi.v1.Identity/Probe", &ProbeRequest {})
        .unwrap();
    assert_eq!(probe.ready, Some(BoolValue { value: true }));

    // Placed on the node with the most room: store-b, 64M.
    let v1 = volume(
        csi.call(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-1", 8 * M, &[]),
        )
        .unwrap(),
    );
    assert!(v1.volume_id.starts_with("store-b:"), "{v1:?}");
    assert_eq!(v1.capacity_bytes, 8 * M);
    let nqn1 = format!("{NQN_PREFIX}{}", key_of("pvc-1"));
    assert_eq!(v1.volume_context["nqn"], nqn1);
    assert_eq!(b.volumes(), vec![(nqn1.clone(), vec![], vec![8 << 20])]);
    // The same request again: the same volume, nothing more on the node.
    let again = volume(
        csi.call(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-1", 8 * M, &[]),
        )
        .unwrap(),
    );
    assert_eq!(again, v1);
    assert_eq!(b.volumes().len(), 1);
    // The same name with another size, or other parameters: ALREADY_EXISTS.
    assert_eq!(
        code(csi.call::<_, CreateVolumeResponse>(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-1", 16 * M, &[])
        )),
        Code::AlreadyExists
    );
    assert_eq!(
        code(csi.call::<_, CreateVolumeResponse>(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-1", 8 * M, &[("blockSize", "512")])
        )),
        Code::AlreadyExists
    );
    // Bad requests change nothing.
    assert_eq!(
        code(csi.call::<_, CreateVolumeResponse>(
            "/csi.v1.Controller/CreateVolume",
            &create("", 8 * M, &[])
        )),
        Code::InvalidArgument
    );
    assert_eq!(
        code(csi.call::<_, CreateVolumeResponse>(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-x", 8 * M, &[("backend", "pcie")])
        )),
        Code::InvalidArgument
    );
    let mut nocaps = create("pvc-x", 8 * M, &[]);
    nocaps.volume_capabilities.clear();
    assert_eq!(
        code(csi.call::<_, CreateVolumeResponse>("/csi.v1.Controller/CreateVolume", &nocaps)),
        Code::InvalidArgument
    );
    assert_eq!(
        code(csi.call::<_, CreateVolumeResponse>(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-big", 100 * M, &[])
        )),
        Code::ResourceExhausted
    );
    assert_eq!(b.volumes().len(), 1);
    assert_eq!(a.volumes(), vec![]);

    // 56M left on store-b, 48M on store-a: the next one goes to b, then a.
    let v2 = volume(
        csi.call(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-2", 16 * M, &[]),
        )
        .unwrap(),
    );
    assert!(v2.volume_id.starts_with("store-b:"), "{v2:?}");
    let v3 = volume(
        csi.call(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-3", 4 * M, &[("blockSize", "512")]),
        )
        .unwrap(),
    );
    assert!(v3.volume_id.starts_with("store-a:"), "{v3:?}");
    // A pool names its nodes.
    let v4 = volume(
        csi.call(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-4", 4 * M, &[("pool", "fast")]),
        )
        .unwrap(),
    );
    assert!(v4.volume_id.starts_with("store-a:"), "{v4:?}");
    assert_eq!(
        code(csi.call::<_, CreateVolumeResponse>(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-5", 4 * M, &[("pool", "none")])
        )),
        Code::ResourceExhausted
    );

    let cap: GetCapacityResponse = csi
        .call(
            "/csi.v1.Controller/GetCapacity",
            &GetCapacityRequest::default(),
        )
        .unwrap();
    assert_eq!(cap.available_capacity, (48 - 8 + 64 - 24) * M);
    assert_eq!(cap.maximum_volume_size, Some(Int64Value { value: 40 * M }));
    let fast: GetCapacityResponse = csi
        .call(
            "/csi.v1.Controller/GetCapacity",
            &GetCapacityRequest {
                parameters: [("pool".to_string(), "fast".to_string())].into(),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(fast.available_capacity, 40 * M);

    // Publish: the host NQN (the node ID) is allowed on the subsystem.
    let publish = |vol: &str, node: &str| ControllerPublishVolumeRequest {
        volume_id: vol.into(),
        node_id: node.into(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    };
    let p: ControllerPublishVolumeResponse = csi
        .call(
            "/csi.v1.Controller/ControllerPublishVolume",
            &publish(&v1.volume_id, HOST1),
        )
        .unwrap();
    assert_eq!(p.publish_context["nqn"], nqn1);
    assert_eq!(p.publish_context["trsvcid"], b.port.to_string());
    let _: ControllerPublishVolumeResponse = csi
        .call(
            "/csi.v1.Controller/ControllerPublishVolume",
            &publish(&v1.volume_id, HOST1),
        )
        .unwrap();
    assert_eq!(
        b.volumes()[b.volumes().iter().position(|v| v.0 == nqn1).unwrap()].1,
        vec![HOST1.to_string()]
    );
    // A single-node volume is not published to a second node; unknown volumes and nodes
    // are NOT_FOUND.
    assert_eq!(
        code(csi.call::<_, ControllerPublishVolumeResponse>(
            "/csi.v1.Controller/ControllerPublishVolume",
            &publish(&v1.volume_id, HOST2)
        )),
        Code::FailedPrecondition
    );
    assert_eq!(
        code(csi.call::<_, ControllerPublishVolumeResponse>(
            "/csi.v1.Controller/ControllerPublishVolume",
            &publish(&v1.volume_id, "some-fake-node-id")
        )),
        Code::NotFound
    );
    let missing = format!("store-b:{}:1", key_of("never-made"));
    assert_eq!(
        code(csi.call::<_, ControllerPublishVolumeResponse>(
            "/csi.v1.Controller/ControllerPublishVolume",
            &publish(&missing, HOST1)
        )),
        Code::NotFound
    );

    // With a DH-HMAC-CHAP key in the publish secret, the host is allowed with it.
    const KEY: &str = "DHHC-1:00:ZXhhbXBsZS1rZXktZm9yLXVuaXQtdGVzdHMtMzJieXR38mKy:";
    let mut with_key = publish(&v3.volume_id, HOST2);
    with_key.secrets = [("dhchapKey".to_string(), KEY.to_string())].into();
    for _ in 0..2 {
        let _: ControllerPublishVolumeResponse = csi
            .call("/csi.v1.Controller/ControllerPublishVolume", &with_key)
            .unwrap();
    }
    let listed: Value = serde_json::from_str(&ctl_ok(&a.socket, &["-o", "json", "list"])).unwrap();
    let nqn3 = &v3.volume_context["nqn"];
    let sub = listed["status"]["subsystems"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["nqn"] == nqn3.as_str())
        .unwrap();
    assert_eq!(sub["dhchap_hosts"], serde_json::json!([HOST2]), "{sub}");
    let mut bad_key = with_key.clone();
    bad_key.secrets = [("dhchapCtrlKey".to_string(), KEY.to_string())].into();
    assert_eq!(
        code(csi.call::<_, ControllerPublishVolumeResponse>(
            "/csi.v1.Controller/ControllerPublishVolume",
            &bad_key
        )),
        Code::InvalidArgument
    );
    let _: ControllerUnpublishVolumeResponse = csi
        .call(
            "/csi.v1.Controller/ControllerUnpublishVolume",
            &ControllerUnpublishVolumeRequest {
                volume_id: v3.volume_id.clone(),
                node_id: HOST2.into(),
            },
        )
        .unwrap();
    assert_eq!(
        a.volumes().iter().find(|v| &v.0 == nqn3).unwrap().1,
        Vec::<String>::new()
    );

    // ListVolumes pages through all four, with the published node.
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page: ListVolumesResponse = csi
            .call(
                "/csi.v1.Controller/ListVolumes",
                &ListVolumesRequest {
                    max_entries: 3,
                    starting_token: token.clone(),
                },
            )
            .unwrap();
        assert!(page.entries.len() <= 3);
        seen.extend(page.entries);
        if page.next_token.is_empty() {
            break;
        }
        token = page.next_token;
    }
    let mut ids: Vec<_> = seen
        .iter()
        .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
        .collect();
    ids.sort();
    let mut want = vec![
        v1.volume_id.clone(),
        v2.volume_id.clone(),
        v3.volume_id.clone(),
        v4.volume_id.clone(),
    ];
    want.sort();
    assert_eq!(ids, want);
    let e1 = seen
        .iter()
        .find(|e| e.volume.as_ref().unwrap().volume_id == v1.volume_id)
        .unwrap();
    assert_eq!(
        e1.status.as_ref().unwrap().published_node_ids,
        vec![HOST1.to_string()]
    );
    assert_eq!(
        code(csi.call::<_, ListVolumesResponse>(
            "/csi.v1.Controller/ListVolumes",
            &ListVolumesRequest {
                max_entries: 0,
                starting_token: "99".into()
            }
        )),
        Code::Aborted
    );

    // Expand: the namespace grows on the node.
    let grow = ControllerExpandVolumeRequest {
        volume_id: v1.volume_id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: 12 * M,
            limit_bytes: 0,
        }),
        volume_capability: Some(mount_cap()),
    };
    let g: ControllerExpandVolumeResponse = csi
        .call("/csi.v1.Controller/ControllerExpandVolume", &grow)
        .unwrap();
    assert_eq!(
        (g.capacity_bytes, g.node_expansion_required),
        (12 * M, true)
    );
    let g2: ControllerExpandVolumeResponse = csi
        .call("/csi.v1.Controller/ControllerExpandVolume", &grow)
        .unwrap();
    assert_eq!(g2.capacity_bytes, 12 * M);
    assert!(
        b.volumes()
            .contains(&(nqn1.clone(), vec![HOST1.to_string()], vec![12 << 20]))
    );
    let mut huge = grow.clone();
    huge.capacity_range = Some(CapacityRange {
        required_bytes: 500 * M,
        limit_bytes: 0,
    });
    assert_eq!(
        code(csi.call::<_, ControllerExpandVolumeResponse>(
            "/csi.v1.Controller/ControllerExpandVolume",
            &huge
        )),
        Code::ResourceExhausted
    );

    // Unpublish, twice; then delete, twice.
    let unpublish = ControllerUnpublishVolumeRequest {
        volume_id: v1.volume_id.clone(),
        node_id: HOST1.into(),
    };
    for _ in 0..2 {
        let _: ControllerUnpublishVolumeResponse = csi
            .call("/csi.v1.Controller/ControllerUnpublishVolume", &unpublish)
            .unwrap();
    }
    assert!(
        b.volumes()
            .contains(&(nqn1.clone(), vec![], vec![12 << 20]))
    );
    // A volume deleted between pages skips none of the others.
    let list = |max, token: &str| -> ListVolumesResponse {
        csi.call(
            "/csi.v1.Controller/ListVolumes",
            &ListVolumesRequest {
                max_entries: max,
                starting_token: token.into(),
            },
        )
        .unwrap()
    };
    let ids = |r: &ListVolumesResponse| -> Vec<String> {
        r.entries
            .iter()
            .map(|e| e.volume.as_ref().unwrap().volume_id.clone())
            .collect()
    };
    let page = list(2, "");
    let gone = ids(&page)[1].clone();
    let _: DeleteVolumeResponse = csi
        .call(
            "/csi.v1.Controller/DeleteVolume",
            &DeleteVolumeRequest {
                volume_id: gone.clone(),
            },
        )
        .unwrap();
    let rest = list(0, &page.next_token);
    assert_eq!(ids(&rest), want[2..].to_vec(), "after deleting {gone}");
    for v in [&v1, &v2, &v3, &v4] {
        for _ in 0..2 {
            let _: DeleteVolumeResponse = csi
                .call(
                    "/csi.v1.Controller/DeleteVolume",
                    &DeleteVolumeRequest {
                        volume_id: v.volume_id.clone(),
                    },
                )
                .unwrap();
        }
    }
    let _: DeleteVolumeResponse = csi
        .call(
            "/csi.v1.Controller/DeleteVolume",
            &DeleteVolumeRequest {
                volume_id: "not-a-volume".into(),
            },
        )
        .unwrap();
    assert_eq!(a.volumes(), vec![]);
    assert_eq!(b.volumes(), vec![]);
    assert!(!csi.log().contains("panicked"), "{}", csi.log());
}

#[test]
fn a_create_volume_survives_a_target_restart_and_completes_a_half_made_volume() {
    let dir = pki();
    let mut s = Store::start(dir.path(), "store");
    let csi = Csi::start(dir.path(), &s.entry("default", "64M"));

    // The storage node goes down; a CreateVolume waits for it (the driver retries) and the
    // node comes back: the volume exists exactly once.
    s.target.take().unwrap().crash();
    let socket = csi.socket.clone();
    let pending = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut c = Client::connect(&socket).await?;
            c.call::<_, CreateVolumeResponse>(
                "/csi.v1.Controller/CreateVolume",
                &create("pvc-r", 8 * M, &[]),
            )
            .await
        })
    });
    // The node comes back once the driver has found it gone.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !csi.log().contains("unreachable; retrying") {
        assert!(
            Instant::now() < deadline,
            "the driver never tried: {}",
            csi.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    s.run();
    let made = volume(
        pending
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("{e}\n{}", csi.log())),
    );
    let nqn = format!("{NQN_PREFIX}{}", key_of("pvc-r"));
    assert_eq!(s.volumes(), vec![(nqn.clone(), vec![], vec![8 << 20])]);
    let again = volume(
        csi.call(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-r", 8 * M, &[]),
        )
        .unwrap(),
    );
    assert_eq!(again, made);
    assert_eq!(s.volumes().len(), 1);

    // A try that made the subsystem but not its namespace (the node went down between
    // the two requests): the next CreateVolume completes it.
    let half = format!("{NQN_PREFIX}{}", key_of("pvc-h"));
    ctl_ok(
        &s.socket,
        &["add-subsystem", "--nqn", &half, "--host", NO_HOST],
    );
    let v = volume(
        csi.call(
            "/csi.v1.Controller/CreateVolume",
            &create("pvc-h", 4 * M, &[]),
        )
        .unwrap(),
    );
    assert_eq!(v.volume_context["nqn"], half);
    assert_eq!(s.volumes(), {
        let mut w = vec![(nqn, vec![], vec![8 << 20]), (half, vec![], vec![4 << 20])];
        w.sort();
        w
    });
}

/// `csi-sanity` from `$CSI_SANITY`, `PATH` or `~/go/bin`.
fn csi_sanity() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CSI_SANITY") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(Path::new(&home).join("go/bin"));
    }
    dirs.into_iter()
        .map(|d| d.join("csi-sanity"))
        .find(|p| p.is_file())
}

#[test]
fn csi_sanity_passes_the_identity_and_controller_specs() {
    let Some(sanity) = csi_sanity() else {
        eprintln!(
            "csi_sanity_passes_the_identity_and_controller_specs: SKIPPED: csi-sanity is not installed (set $CSI_SANITY to a build of github.com/kubernetes-csi/csi-test's cmd/csi-sanity)"
        );
        return;
    };
    let dir = pki();
    let s = Store::start(dir.path(), "store");
    let csi = Csi::start(dir.path(), &s.entry("default", "1T"));
    let staging = dir.path().join("staging");
    let target = dir.path().join("target");
    let out = Command::new(&sanity)
        .arg(format!("--csi.endpoint={}", csi.socket.display()))
        .arg(format!("--csi.stagingdir={}", staging.display()))
        .arg(format!("--csi.mountdir={}", target.display()))
        .arg(format!("--csi.testvolumesize={}", 64 * M))
        .arg(format!("--csi.testvolumeexpandsize={}", 128 * M))
        // The Node specs mount real file systems: the QEMU guest test runs those.
        .arg("--ginkgo.skip=Node Service")
        .output()
        .expect("run csi-sanity");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(
        out.status.success(),
        "csi-sanity failed:\n{text}\ndriver log:\n{}",
        csi.log()
    );
    assert_eq!(s.volumes(), vec![], "csi-sanity deletes what it makes");
}

/// A program on `PATH`.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[test]
fn kubernetes_manifests_validate_and_name_this_driver() {
    let dir = nvmeof_tests::workspace_root().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "{files:?}");
    // The driver's name and the StorageClass parameters are the ones the driver knows.
    let text = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    assert!(text("csidriver.yaml").contains(&format!("name: {}", nvmeof_csi::DRIVER_NAME)));
    let sc = text("storageclass.yaml");
    assert!(sc.contains(&format!("provisioner: {}", nvmeof_csi::DRIVER_NAME)));
    for p in ["backend: file", "blockSize: \"4096\"", "pool: default"] {
        assert!(sc.contains(p), "{p}");
    }
    assert!(text("node.yaml").contains(&format!("plugins/{}/csi.sock", nvmeof_csi::DRIVER_NAME)));
    // The controller's configuration in the Secret example parses.
    let secret = text("secret-example.yaml");
    let start = secret.find("csi.toml: |\n").unwrap() + "csi.toml: |\n".len();
    let toml: String = secret[start..]
        .lines()
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    nvmeof_csi::controller::ControllerConfig::parse(&toml)
        .unwrap_or_else(|e| panic!("{e}\n{toml}"));

    let validate = std::env::var_os("KUBERNETES_VALIDATE")
        .map(PathBuf::from)
        .or_else(|| on_path("kubernetes-validate"));
    let Some(validate) = validate else {
        eprintln!(
            "kubernetes_manifests_validate_and_name_this_driver: schema check SKIPPED: kubernetes-validate is not installed (scripts/test.sh installs it in a venv and sets $KUBERNETES_VALIDATE)"
        );
        return;
    };
    // Strict: the Kubernetes JSON schemas shipped in the package, unknown fields refused.
    let out = Command::new(validate)
        .arg("--strict")
        .args(&files)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(!text.contains("ERROR"), "{text}");
}

/// The Node service in the QEMU guest with the Linux kernel NVMe/TCP host, the storage node
/// on the host: `tests/interop/guest-scripts/csi-node.sh` runs the driver's `csi_flow`
/// example, which takes one ext4 volume through its life, checking the target's listing at
/// every step.
#[test]
fn node_service_in_the_guest_stages_grows_and_restages_a_real_ext4_volume() {
    if nvmeof_tests::skip_without_interop() {
        return;
    }
    let flow = bin_path("nvmeof-targetd")
        .with_file_name("examples")
        .join("csi_flow");
    assert!(
        flow.exists(),
        "{} is not built (cargo build -p nvmeof-csi --example csi_flow)",
        flow.display()
    );
    let resize2fs = ["/usr/sbin/resize2fs", "/sbin/resize2fs"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("resize2fs (e2fsprogs) on the host");
    let dir = pki();
    let s = Store::start(dir.path(), "store");
    // The guest reaches the host's loopback as 10.0.2.2.
    let entry = s.entry("default", "256M").replace("127.0.0.1", "10.0.2.2");
    let p = |f: &str| format!("{}:/csi/{f}", dir.path().join(f).display());
    std::fs::write(
        dir.path().join("csi.toml"),
        format!("[tls]\nca = \"/csi/ca.pem\"\ncert = \"/csi/csi.pem\"\nkey = \"/csi/csi.key\"\n\n{entry}"),
    )
    .unwrap();
    // csi-sanity's specs, the Node service's included, where a build of it is given.
    let sanity = csi_sanity();
    let extra: Vec<String> = sanity
        .iter()
        .flat_map(|p| {
            [
                "--add-bin".to_string(),
                format!("{}:/usr/bin/csi-sanity", p.display()),
            ]
        })
        .collect();
    let console = nvmeof_tests::run_guest(
        Command::new(nvmeof_tests::guest_sh())
            .args([
                "run",
                "--with-ext4",
                "--timeout",
                "300",
                "--fail-on-kernel-trace",
            ])
            .args(["--env", &format!("REMOTE=10.0.2.2:{}", s.remote)])
            .args(&extra)
            .args([
                "--add",
                &p("csi.toml"),
                "--add",
                &p("ca.pem"),
                "--add",
                &p("csi.pem"),
                "--add",
                &p("csi.key"),
            ])
            .arg("--add-bin")
            .arg(format!(
                "{}:/usr/bin/nvmeof-csi",
                bin_path("nvmeof-csi").display()
            ))
            .arg("--add-bin")
            .arg(format!("{}:/usr/bin/csi_flow", flow.display()))
            .arg("--add-bin")
            .arg(format!(
                "{}:/usr/bin/nvmeof-targetd",
                bin_path("nvmeof-targetd").display()
            ))
            .arg("--add-bin")
            .arg(format!("{resize2fs}:/usr/sbin/resize2fs"))
            .arg(nvmeof_tests::workspace_root().join("tests/interop/guest-scripts/csi-node.sh")),
    );
    nvmeof_tests::assert_console_has(
        &console,
        &[
            "PASS: created: ctl list shows Some(([], [16777216]))",
            "PASS: staged: the kernel host has a block device with the volume's UUID",
            "PASS: staged: ext4 mounted at the staging path",
            "PASS: published: bind mount at the target path",
            "PASS: expanded: ctl list shows",
            "PASS: node sees 33554432 bytes",
            "PASS: unstaged: the kernel host disconnected",
            "PASS: restaged over the existing connection",
            "PASS: restaged: the data written before reads back the same",
            "PASS: deleted: ctl list shows None",
            "PASS: block volume: 64 KiB written and read back through the target path",
            "PASS: block volume deleted: ctl list shows None",
            "PASS: nvmeof-csi in the guest",
        ],
    );
    if sanity.is_some() {
        nvmeof_tests::assert_console_has(&console, &["PASS: csi-sanity in the guest"]);
    } else {
        eprintln!(
            "node_service_in_the_guest: csi-sanity SKIPPED: csi-sanity is not installed (set $CSI_SANITY)"
        );
    }
    assert_eq!(
        s.volumes(),
        vec![],
        "the target's own listing agrees: nothing left"
    );
}
