//! Drives one volume through its whole life with the CSI calls a Kubernetes cluster makes,
//! against a running `nvmeof-csi` serving the Controller and Node services on this machine,
//! and checks each step against the storage node's own listing (`nvmeof-targetd ctl
//! --remote`) and the kernel's view (sysfs, mounts). Used by the QEMU guest test.
//!
//! ```text
//! csi_flow ENDPOINT REMOTE CA CERT KEY
//! ```
//! Prints `PASS: ...` per step; exits non-zero with `FAIL: ...` on the first failure.

use std::path::{Path, PathBuf};
use std::process::Command;

use nvmeof_csi::grpc::{Client, Status};
use nvmeof_csi::proto::*;
use serde_json::Value;

const M: i64 = 1 << 20;
const STAGING: &str = "/var/lib/kubelet/plugins/csi/staging/pvc-guest";
const TARGET: &str = "/var/lib/kubelet/pods/pod-1/volumes/pvc-guest";

struct Flow {
    socket: PathBuf,
    ctl: Vec<String>,
    rt: tokio::runtime::Runtime,
}

impl Flow {
    fn call<Q: prost::Message, R: prost::Message + Default>(&self, method: &str, req: &Q) -> R {
        let r: Result<R, Status> = self.rt.block_on(async {
            let mut c = Client::connect(&self.socket).await?;
            c.call(method, req).await
        });
        r.unwrap_or_else(|e| fail(&format!("{method}: {e}")))
    }

    /// The volume's subsystem as the storage node lists it: (hosts, namespace sizes).
    fn listed(&self, nqn: &str) -> Option<(Vec<String>, Vec<u64>)> {
        let out = Command::new("nvmeof-targetd")
            .args(&self.ctl)
            .arg("list")
            .output()
            .unwrap_or_else(|e| fail(&format!("nvmeof-targetd ctl: {e}")));
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            fail(&format!(
                "ctl list: {e}: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        });
        let s = v["status"]["subsystems"]
            .as_array()?
            .iter()
            .find(|s| s["nqn"] == nqn)?;
        let hosts = s["hosts"]
            .as_array()?
            .iter()
            .filter_map(|h| h.as_str())
            .filter(|h| *h != nvmeof_csi::controller::NO_HOST)
            .map(String::from)
            .collect();
        let sizes = s["namespaces"]
            .as_array()?
            .iter()
            .filter_map(|n| n["size"].as_u64())
            .collect();
        Some((hosts, sizes))
    }

    fn expect_listed(&self, nqn: &str, want: Option<(Vec<String>, Vec<u64>)>, what: &str) {
        let got = self.listed(nqn);
        if got != want {
            fail(&format!(
                "{what}: ctl list shows {got:?}, expected {want:?}"
            ));
        }
        println!("PASS: {what}: ctl list shows {got:?}");
    }
}

fn fail(msg: &str) -> ! {
    println!("FAIL: {msg}");
    std::process::exit(1)
}

fn check(ok: bool, msg: &str) {
    if !ok {
        fail(msg);
    }
    println!("PASS: {msg}");
}

fn mounted(path: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(path))
}

fn device_present(uuid: &str) -> bool {
    std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| std::fs::read_to_string(e.path().join("uuid")).is_ok_and(|u| u.trim() == uuid))
}

fn pattern() -> Vec<u8> {
    (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        eprintln!("usage: csi_flow ENDPOINT REMOTE CA CERT KEY");
        std::process::exit(2);
    }
    let flow = Flow {
        socket: PathBuf::from(args[1].trim_start_matches("unix://")),
        ctl: [
            "ctl", "-o", "json", "--remote", &args[2], "--ca", &args[3], "--cert", &args[4],
            "--key", &args[5],
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
    };
    let cap = VolumeCapability {
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: vec![],
        })),
        access_mode: Some(AccessMode {
            mode: MODE_SINGLE_NODE_WRITER,
        }),
    };

    let info: NodeGetInfoResponse = flow.call("/csi.v1.Node/NodeGetInfo", &NodeGetInfoRequest {});
    let host = info.node_id.clone();
    check(
        host.starts_with("nqn."),
        &format!("node ID is the host NQN {host}"),
    );

    // CreateVolume: a 16 MiB file-backed namespace.
    let created: CreateVolumeResponse = flow.call(
        "/csi.v1.Controller/CreateVolume",
        &CreateVolumeRequest {
            name: "pvc-guest".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 16 * M,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        },
    );
    let vol = created
        .volume
        .unwrap_or_else(|| fail("CreateVolume returned no volume"));
    let id = vol.volume_id.clone();
    let nqn = vol.volume_context["nqn"].clone();
    let uuid = vol.volume_context["uuid"].clone();
    println!("volume {id} nqn {nqn} uuid {uuid}");
    flow.expect_listed(&nqn, Some((vec![], vec![16 << 20])), "created");

    // ControllerPublishVolume: the host NQN is allowed.
    let published: ControllerPublishVolumeResponse = flow.call(
        "/csi.v1.Controller/ControllerPublishVolume",
        &ControllerPublishVolumeRequest {
            volume_id: id.clone(),
            node_id: host.clone(),
            volume_capability: Some(cap.clone()),
            readonly: false,
            secrets: Map::new(),
            volume_context: vol.volume_context.clone(),
        },
    );
    flow.expect_listed(
        &nqn,
        Some((vec![host.clone()], vec![16 << 20])),
        "published to this host",
    );

    let stage = NodeStageVolumeRequest {
        volume_id: id.clone(),
        publish_context: published.publish_context.clone(),
        staging_target_path: STAGING.into(),
        volume_capability: Some(cap.clone()),
        secrets: Map::new(),
        volume_context: vol.volume_context.clone(),
    };
    let publish = NodePublishVolumeRequest {
        volume_id: id.clone(),
        publish_context: published.publish_context.clone(),
        staging_target_path: STAGING.into(),
        target_path: TARGET.into(),
        volume_capability: Some(cap.clone()),
        readonly: false,
        volume_context: vol.volume_context.clone(),
    };
    let unpublish = NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: TARGET.into(),
    };
    let unstage = NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: STAGING.into(),
    };

    // NodeStage (twice: the second changes nothing) and NodePublish (twice).
    for _ in 0..2 {
        let _: NodeStageVolumeResponse = flow.call("/csi.v1.Node/NodeStageVolume", &stage);
    }
    check(
        device_present(&uuid),
        "staged: the kernel host has a block device with the volume's UUID",
    );
    check(mounted(STAGING), "staged: ext4 mounted at the staging path");
    for _ in 0..2 {
        let _: NodePublishVolumeResponse = flow.call("/csi.v1.Node/NodePublishVolume", &publish);
    }
    check(mounted(TARGET), "published: bind mount at the target path");

    // Write through the pod's path.
    let file = Path::new(TARGET).join("data.bin");
    std::fs::write(&file, pattern()).unwrap_or_else(|e| fail(&format!("write: {e}")));
    std::fs::File::open(&file)
        .and_then(|f| f.sync_all())
        .unwrap_or_else(|e| fail(&format!("sync: {e}")));
    println!("PASS: wrote 1 MiB through the published path");
    let stats = |path: &str| -> i64 {
        let s: NodeGetVolumeStatsResponse = flow.call(
            "/csi.v1.Node/NodeGetVolumeStats",
            &NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: path.into(),
                staging_target_path: STAGING.into(),
            },
        );
        s.usage
            .iter()
            .find(|u| u.unit == UNIT_BYTES)
            .map_or(0, |u| u.total)
    };
    let before = stats(TARGET);
    check(
        before > 8 * M && before <= 16 * M,
        &format!("volume stats: {before} bytes in the file system"),
    );

    // ControllerExpandVolume to 32 MiB, then NodeExpandVolume grows ext4.
    let grown: ControllerExpandVolumeResponse = flow.call(
        "/csi.v1.Controller/ControllerExpandVolume",
        &ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 32 * M,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap.clone()),
        },
    );
    check(
        grown.capacity_bytes == 32 * M && grown.node_expansion_required,
        "controller expanded to 32 MiB",
    );
    flow.expect_listed(&nqn, Some((vec![host.clone()], vec![32 << 20])), "expanded");
    let node_grown: NodeExpandVolumeResponse = flow.call(
        "/csi.v1.Node/NodeExpandVolume",
        &NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: TARGET.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 32 * M,
                limit_bytes: 0,
            }),
            staging_target_path: STAGING.into(),
            volume_capability: Some(cap.clone()),
        },
    );
    check(
        node_grown.capacity_bytes == 32 * M,
        &format!("node sees {} bytes", node_grown.capacity_bytes),
    );
    let after = stats(TARGET);
    check(
        after > before + 8 * M,
        &format!("file system grew from {before} to {after} bytes"),
    );

    // Unpublish and unstage (twice each), then stage and publish again: the data is there.
    for _ in 0..2 {
        let _: NodeUnpublishVolumeResponse =
            flow.call("/csi.v1.Node/NodeUnpublishVolume", &unpublish);
    }
    for _ in 0..2 {
        let _: NodeUnstageVolumeResponse = flow.call("/csi.v1.Node/NodeUnstageVolume", &unstage);
    }
    check(
        !mounted(TARGET) && !mounted(STAGING),
        "unpublished and unstaged: nothing mounted",
    );
    check(
        !device_present(&uuid),
        "unstaged: the kernel host disconnected",
    );
    flow.expect_listed(
        &nqn,
        Some((vec![host.clone()], vec![32 << 20])),
        "still published while unstaged",
    );
    // A NodeStage cut short after it connected (the driver restarted): the host is
    // connected, nothing is mounted; the next NodeStage finishes the job.
    let ctx = &published.publish_context;
    let connect = Command::new("nvme")
        .args([
            "connect",
            "-t",
            "tcp",
            "-a",
            &ctx["traddr"],
            "-s",
            &ctx["trsvcid"],
            "-n",
            &nqn,
            "--hostnqn",
            &host,
        ])
        .status();
    check(
        connect.is_ok_and(|s| s.success()),
        "connected by hand, as a NodeStage cut short would leave it",
    );
    let _: NodeStageVolumeResponse = flow.call("/csi.v1.Node/NodeStageVolume", &stage);
    check(mounted(STAGING), "restaged over the existing connection");
    let _: NodePublishVolumeResponse = flow.call("/csi.v1.Node/NodePublishVolume", &publish);
    let back = std::fs::read(&file).unwrap_or_else(|e| fail(&format!("read after restage: {e}")));
    check(
        back == pattern(),
        "restaged: the data written before reads back the same",
    );
    check(
        stats(TARGET) == after,
        "restaged: the file system keeps its grown size",
    );

    // Tear down: unpublish, unstage, controller unpublish, delete.
    let _: NodeUnpublishVolumeResponse = flow.call("/csi.v1.Node/NodeUnpublishVolume", &unpublish);
    let _: NodeUnstageVolumeResponse = flow.call("/csi.v1.Node/NodeUnstageVolume", &unstage);
    check(!device_present(&uuid), "unstaged again: disconnected");
    let _: ControllerUnpublishVolumeResponse = flow.call(
        "/csi.v1.Controller/ControllerUnpublishVolume",
        &ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: host.clone(),
        },
    );
    flow.expect_listed(
        &nqn,
        Some((vec![], vec![32 << 20])),
        "controller unpublished",
    );
    let _: DeleteVolumeResponse = flow.call(
        "/csi.v1.Controller/DeleteVolume",
        &DeleteVolumeRequest {
            volume_id: id.clone(),
        },
    );
    flow.expect_listed(&nqn, None, "deleted");

    // A raw block volume: the device itself is bind-mounted at the target path.
    let block = VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode {
            mode: MODE_SINGLE_NODE_WRITER,
        }),
    };
    let created: CreateVolumeResponse = flow.call(
        "/csi.v1.Controller/CreateVolume",
        &CreateVolumeRequest {
            name: "pvc-block".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 8 * M,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![block.clone()],
            ..Default::default()
        },
    );
    let bvol = created
        .volume
        .unwrap_or_else(|| fail("CreateVolume returned no volume"));
    let bnqn = bvol.volume_context["nqn"].clone();
    let published: ControllerPublishVolumeResponse = flow.call(
        "/csi.v1.Controller/ControllerPublishVolume",
        &ControllerPublishVolumeRequest {
            volume_id: bvol.volume_id.clone(),
            node_id: host.clone(),
            volume_capability: Some(block.clone()),
            readonly: false,
            secrets: Map::new(),
            volume_context: bvol.volume_context.clone(),
        },
    );
    const BSTAGING: &str = "/var/lib/kubelet/plugins/csi/staging/pvc-block";
    const BTARGET: &str = "/var/lib/kubelet/pods/pod-2/volumeDevices/pvc-block";
    let _: NodeStageVolumeResponse = flow.call(
        "/csi.v1.Node/NodeStageVolume",
        &NodeStageVolumeRequest {
            volume_id: bvol.volume_id.clone(),
            publish_context: published.publish_context.clone(),
            staging_target_path: BSTAGING.into(),
            volume_capability: Some(block.clone()),
            secrets: Map::new(),
            volume_context: bvol.volume_context.clone(),
        },
    );
    let bpublish = NodePublishVolumeRequest {
        volume_id: bvol.volume_id.clone(),
        publish_context: published.publish_context.clone(),
        staging_target_path: BSTAGING.into(),
        target_path: BTARGET.into(),
        volume_capability: Some(block.clone()),
        readonly: false,
        volume_context: bvol.volume_context.clone(),
    };
    let _: NodePublishVolumeResponse = flow.call("/csi.v1.Node/NodePublishVolume", &bpublish);
    check(
        mounted(BTARGET),
        "block volume published: the device is bound at the target path",
    );
    {
        use std::io::{Read, Seek, Write};
        let data = &pattern()[..64 << 10];
        let mut dev = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(BTARGET)
            .unwrap_or_else(|e| fail(&format!("open {BTARGET}: {e}")));
        dev.write_all(data)
            .and_then(|_| dev.sync_all())
            .unwrap_or_else(|e| fail(&format!("write: {e}")));
        let mut back = vec![0u8; data.len()];
        dev.rewind()
            .and_then(|_| dev.read_exact(&mut back))
            .unwrap_or_else(|e| fail(&format!("read: {e}")));
        check(
            back == data,
            "block volume: 64 KiB written and read back through the target path",
        );
    }
    let s: NodeGetVolumeStatsResponse = flow.call(
        "/csi.v1.Node/NodeGetVolumeStats",
        &NodeGetVolumeStatsRequest {
            volume_id: bvol.volume_id.clone(),
            volume_path: BTARGET.into(),
            staging_target_path: BSTAGING.into(),
        },
    );
    check(
        s.usage.first().is_some_and(|u| u.total == 8 * M),
        "block volume stats: 8 MiB",
    );
    let _: NodeUnpublishVolumeResponse = flow.call(
        "/csi.v1.Node/NodeUnpublishVolume",
        &NodeUnpublishVolumeRequest {
            volume_id: bvol.volume_id.clone(),
            target_path: BTARGET.into(),
        },
    );
    let _: NodeUnstageVolumeResponse = flow.call(
        "/csi.v1.Node/NodeUnstageVolume",
        &NodeUnstageVolumeRequest {
            volume_id: bvol.volume_id.clone(),
            staging_target_path: BSTAGING.into(),
        },
    );
    check(
        !mounted(BTARGET) && !Path::new(BTARGET).exists(),
        "block volume unpublished: the target path is gone",
    );
    check(
        !device_present(&bvol.volume_context["uuid"]),
        "block volume unstaged: disconnected",
    );
    let _: ControllerUnpublishVolumeResponse = flow.call(
        "/csi.v1.Controller/ControllerUnpublishVolume",
        &ControllerUnpublishVolumeRequest {
            volume_id: bvol.volume_id.clone(),
            node_id: host.clone(),
        },
    );
    let _: DeleteVolumeResponse = flow.call(
        "/csi.v1.Controller/DeleteVolume",
        &DeleteVolumeRequest {
            volume_id: bvol.volume_id.clone(),
        },
    );
    flow.expect_listed(&bnqn, None, "block volume deleted");
    println!("PASS: CSI volume lifecycle on the kernel NVMe/TCP host");
}
