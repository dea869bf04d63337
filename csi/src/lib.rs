//! `nvmeof-csi`: a Kubernetes CSI driver (Container Storage Interface, spec 1.9 and later)
//! for nvmeof-direct. One binary serves the CSI Identity, Controller and Node services as
//! gRPC on a Unix socket.
//!
//! - **Controller** ([`controller`]): CreateVolume and DeleteVolume make and remove
//!   namespaces on a pool of storage nodes running `nvmeof-targetd`, through each node's
//!   remote control API (mutual TLS; the driver's client certificate must be an admin of the
//!   node). Placement is capacity-aware (the node of the pool with the most room), volume IDs
//!   (`NODE:KEY:NSID`) derive from the volume name, so the driver keeps no state and a retried
//!   request finds what an earlier one made. ControllerPublish/Unpublish allow and disallow
//!   the node's host NQN (the node ID); ControllerExpandVolume grows the namespace;
//!   GetCapacity and ListVolumes read the nodes' listings.
//! - **Node** ([`node`]): NodeStage connects the kernel NVMe/TCP host (`nvme connect`), finds
//!   the block device by the namespace UUID in sysfs, makes ext4 when the volume has no file
//!   system and mounts it at the staging path; NodePublish bind-mounts it (or the block
//!   device); NodeUnpublish and NodeUnstage undo that and disconnect; NodeExpandVolume
//!   rescans the namespace and runs `resize2fs`; NodeGetVolumeStats reads statvfs.
//! - **Identity**: the driver's name ([`DRIVER_NAME`]), its capabilities, Probe.
//!
//! Dependencies are kept few: gRPC is done by hand on `h2` (HTTP/2) with `prost` messages
//! written from the spec's field numbers ([`proto`]): no code generation, no `protoc`, and
//! none of tonic's stack (tower, hyper, axum) for the four unary-call shapes CSI needs. The
//! remote control client is the target crate's own ([`nvmeof_target::remote`]).

pub mod controller;
pub mod grpc;
pub mod node;
pub mod proto;

use std::sync::Arc;

use bytes::Bytes;

use crate::controller::Controller;
use crate::grpc::{Code, Reply, Service, Status, decode, fail};
use crate::node::Node;
use crate::proto::*;

/// The driver's name (the CSIDriver object's and the StorageClass's `provisioner`).
pub const DRIVER_NAME: &str = "nvmeof.csi.nvmeof-direct.io";

/// The services this process serves: Identity always, Controller and Node when configured.
pub struct Driver {
    /// The Controller service (`None`: calls to it are UNIMPLEMENTED).
    pub controller: Option<Controller>,
    /// The Node service (`None`: calls to it are UNIMPLEMENTED).
    pub node: Option<Node>,
}

fn encode<M: prost::Message>(r: Result<M, Status>) -> Result<Vec<u8>, Status> {
    r.map(|m| m.encode_to_vec())
}

impl Driver {
    fn controller(&self) -> Result<&Controller, Status> {
        self.controller.as_ref().ok_or_else(|| {
            Status::new(
                Code::Unimplemented,
                "this process serves no Controller service",
            )
        })
    }

    fn node(&self) -> Result<&Node, Status> {
        self.node
            .as_ref()
            .ok_or_else(|| Status::new(Code::Unimplemented, "this process serves no Node service"))
    }

    async fn dispatch(&self, path: &str, m: Bytes) -> Result<Vec<u8>, Status> {
        match path {
            "/csi.v1.Identity/GetPluginInfo" => {
                decode::<GetPluginInfoRequest>(m)?;
                encode(Ok(GetPluginInfoResponse {
                    name: DRIVER_NAME.into(),
                    vendor_version: env!("CARGO_PKG_VERSION").into(),
                }))
            }
            "/csi.v1.Identity/GetPluginCapabilities" => {
                decode::<GetPluginCapabilitiesRequest>(m)?;
                let mut caps = vec![PluginCapability {
                    r#type: Some(PluginCapabilityType::VolumeExpansion(TypeOnly {
                        r#type: EXPANSION_ONLINE,
                    })),
                }];
                if self.controller.is_some() {
                    caps.push(PluginCapability {
                        r#type: Some(PluginCapabilityType::Service(TypeOnly {
                            r#type: PLUGIN_CONTROLLER_SERVICE,
                        })),
                    });
                }
                encode(Ok(GetPluginCapabilitiesResponse { capabilities: caps }))
            }
            "/csi.v1.Identity/Probe" => {
                decode::<ProbeRequest>(m)?;
                encode(Ok(ProbeResponse {
                    ready: Some(BoolValue { value: true }),
                }))
            }
            "/csi.v1.Controller/CreateVolume" => {
                encode(self.controller()?.create_volume(decode(m)?).await)
            }
            "/csi.v1.Controller/DeleteVolume" => {
                encode(self.controller()?.delete_volume(decode(m)?).await)
            }
            "/csi.v1.Controller/ControllerPublishVolume" => {
                encode(self.controller()?.publish(decode(m)?).await)
            }
            "/csi.v1.Controller/ControllerUnpublishVolume" => {
                encode(self.controller()?.unpublish(decode(m)?).await)
            }
            "/csi.v1.Controller/ValidateVolumeCapabilities" => {
                encode(self.controller()?.validate(decode(m)?).await)
            }
            "/csi.v1.Controller/ListVolumes" => {
                encode(self.controller()?.list_volumes(decode(m)?).await)
            }
            "/csi.v1.Controller/GetCapacity" => {
                encode(self.controller()?.get_capacity(decode(m)?).await)
            }
            "/csi.v1.Controller/ControllerExpandVolume" => {
                encode(self.controller()?.expand(decode(m)?).await)
            }
            "/csi.v1.Controller/ControllerGetCapabilities" => {
                decode::<ControllerGetCapabilitiesRequest>(m)?;
                self.controller()?;
                encode(Ok(Controller::capabilities()))
            }
            "/csi.v1.Node/NodeStageVolume" => encode(self.node()?.stage(decode(m)?).await),
            "/csi.v1.Node/NodeUnstageVolume" => encode(self.node()?.unstage(decode(m)?).await),
            "/csi.v1.Node/NodePublishVolume" => encode(self.node()?.publish(decode(m)?).await),
            "/csi.v1.Node/NodeUnpublishVolume" => encode(self.node()?.unpublish(decode(m)?).await),
            "/csi.v1.Node/NodeGetVolumeStats" => encode(self.node()?.stats(decode(m)?).await),
            "/csi.v1.Node/NodeExpandVolume" => encode(self.node()?.expand(decode(m)?).await),
            "/csi.v1.Node/NodeGetCapabilities" => {
                decode::<NodeGetCapabilitiesRequest>(m)?;
                self.node()?;
                encode(Ok(Node::capabilities()))
            }
            "/csi.v1.Node/NodeGetInfo" => {
                decode::<NodeGetInfoRequest>(m)?;
                encode(Ok(self.node()?.info()))
            }
            _ => fail(Code::Unimplemented, format!("{path} is not implemented")),
        }
    }
}

impl Service for Driver {
    fn call(self: Arc<Self>, path: &str, message: Bytes) -> Reply {
        let path = path.to_string();
        Box::pin(async move { self.dispatch(&path, message).await })
    }
}
