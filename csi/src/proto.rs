//! The CSI messages this driver exchanges, written from the field numbers of the CSI
//! specification (version 1.9 and later; package `csi.v1`). Enumerations are carried as
//! `i32` (their wire form); the constants beside each message name the values used here.
//! Fields this driver never reads or sets are left out: protobuf skips unknown fields.
#![allow(missing_docs)]

use std::collections::HashMap;

/// A string map (`map<string, string>`).
pub type Map = HashMap<String, String>;

macro_rules! empty {
    ($($name:ident),* $(,)?) => {$(
        /// A message without fields.
        #[derive(Clone, PartialEq, ::prost::Message)]
        pub struct $name {}
    )*};
}

empty!(
    GetPluginInfoRequest,
    GetPluginCapabilitiesRequest,
    ProbeRequest,
    DeleteVolumeResponse,
    ControllerUnpublishVolumeResponse,
    ControllerGetCapabilitiesRequest,
    NodeStageVolumeResponse,
    NodeUnstageVolumeResponse,
    NodePublishVolumeResponse,
    NodeUnpublishVolumeResponse,
    NodeGetCapabilitiesRequest,
    NodeGetInfoRequest,
    BlockVolume,
);

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct GetPluginInfoResponse {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub vendor_version: String,
}

/// `PluginCapability.Service.Type.CONTROLLER_SERVICE`.
pub const PLUGIN_CONTROLLER_SERVICE: i32 = 1;
/// `PluginCapability.VolumeExpansion.Type.ONLINE`.
pub const EXPANSION_ONLINE: i32 = 1;

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct GetPluginCapabilitiesResponse {
    #[prost(message, repeated, tag = "1")]
    pub capabilities: Vec<PluginCapability>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct PluginCapability {
    #[prost(oneof = "PluginCapabilityType", tags = "1, 2")]
    pub r#type: Option<PluginCapabilityType>,
}

#[derive(Clone, PartialEq, ::prost::Oneof)]
pub enum PluginCapabilityType {
    #[prost(message, tag = "1")]
    Service(TypeOnly),
    #[prost(message, tag = "2")]
    VolumeExpansion(TypeOnly),
}

/// A message whose only field is `Type type = 1` (capability entries).
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct TypeOnly {
    #[prost(int32, tag = "1")]
    pub r#type: i32,
}

/// `google.protobuf.BoolValue`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct BoolValue {
    #[prost(bool, tag = "1")]
    pub value: bool,
}

/// `google.protobuf.Int64Value`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Int64Value {
    #[prost(int64, tag = "1")]
    pub value: i64,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ProbeResponse {
    #[prost(message, optional, tag = "1")]
    pub ready: Option<BoolValue>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct CapacityRange {
    #[prost(int64, tag = "1")]
    pub required_bytes: i64,
    #[prost(int64, tag = "2")]
    pub limit_bytes: i64,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct MountVolume {
    #[prost(string, tag = "1")]
    pub fs_type: String,
    #[prost(string, repeated, tag = "2")]
    pub mount_flags: Vec<String>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct AccessMode {
    #[prost(int32, tag = "1")]
    pub mode: i32,
}

/// `AccessMode.Mode.UNKNOWN`.
pub const MODE_UNKNOWN: i32 = 0;
/// `AccessMode.Mode.SINGLE_NODE_WRITER`.
pub const MODE_SINGLE_NODE_WRITER: i32 = 1;

#[derive(Clone, PartialEq, ::prost::Oneof)]
pub enum AccessType {
    #[prost(message, tag = "1")]
    Block(BlockVolume),
    #[prost(message, tag = "2")]
    Mount(MountVolume),
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct VolumeCapability {
    #[prost(oneof = "AccessType", tags = "1, 2")]
    pub access_type: Option<AccessType>,
    #[prost(message, optional, tag = "3")]
    pub access_mode: Option<AccessMode>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct VolumeContentSource {
    #[prost(message, optional, tag = "1")]
    pub snapshot: Option<IdOnly>,
    #[prost(message, optional, tag = "2")]
    pub volume: Option<IdOnly>,
}

/// A message whose only field is a string ID at tag 1 (content sources).
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct IdOnly {
    #[prost(string, tag = "1")]
    pub id: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Topology {
    #[prost(map = "string, string", tag = "1")]
    pub segments: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct CreateVolumeRequest {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub capacity_range: Option<CapacityRange>,
    #[prost(message, repeated, tag = "3")]
    pub volume_capabilities: Vec<VolumeCapability>,
    #[prost(map = "string, string", tag = "4")]
    pub parameters: Map,
    #[prost(map = "string, string", tag = "5")]
    pub secrets: Map,
    #[prost(message, optional, tag = "6")]
    pub volume_content_source: Option<VolumeContentSource>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Volume {
    #[prost(int64, tag = "1")]
    pub capacity_bytes: i64,
    #[prost(string, tag = "2")]
    pub volume_id: String,
    #[prost(map = "string, string", tag = "3")]
    pub volume_context: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct CreateVolumeResponse {
    #[prost(message, optional, tag = "1")]
    pub volume: Option<Volume>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct DeleteVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ControllerPublishVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(string, tag = "2")]
    pub node_id: String,
    #[prost(message, optional, tag = "3")]
    pub volume_capability: Option<VolumeCapability>,
    #[prost(bool, tag = "4")]
    pub readonly: bool,
    #[prost(map = "string, string", tag = "5")]
    pub secrets: Map,
    #[prost(map = "string, string", tag = "6")]
    pub volume_context: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ControllerPublishVolumeResponse {
    #[prost(map = "string, string", tag = "1")]
    pub publish_context: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ControllerUnpublishVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(string, tag = "2")]
    pub node_id: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ValidateVolumeCapabilitiesRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(map = "string, string", tag = "2")]
    pub volume_context: Map,
    #[prost(message, repeated, tag = "3")]
    pub volume_capabilities: Vec<VolumeCapability>,
    #[prost(map = "string, string", tag = "4")]
    pub parameters: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct Confirmed {
    #[prost(map = "string, string", tag = "1")]
    pub volume_context: Map,
    #[prost(message, repeated, tag = "2")]
    pub volume_capabilities: Vec<VolumeCapability>,
    #[prost(map = "string, string", tag = "3")]
    pub parameters: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ValidateVolumeCapabilitiesResponse {
    #[prost(message, optional, tag = "1")]
    pub confirmed: Option<Confirmed>,
    #[prost(string, tag = "2")]
    pub message: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ListVolumesRequest {
    #[prost(int32, tag = "1")]
    pub max_entries: i32,
    #[prost(string, tag = "2")]
    pub starting_token: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct VolumeStatus {
    #[prost(string, repeated, tag = "1")]
    pub published_node_ids: Vec<String>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ListVolumesEntry {
    #[prost(message, optional, tag = "1")]
    pub volume: Option<Volume>,
    #[prost(message, optional, tag = "2")]
    pub status: Option<VolumeStatus>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ListVolumesResponse {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<ListVolumesEntry>,
    #[prost(string, tag = "2")]
    pub next_token: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct GetCapacityRequest {
    #[prost(message, repeated, tag = "1")]
    pub volume_capabilities: Vec<VolumeCapability>,
    #[prost(map = "string, string", tag = "2")]
    pub parameters: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct GetCapacityResponse {
    #[prost(int64, tag = "1")]
    pub available_capacity: i64,
    #[prost(message, optional, tag = "2")]
    pub maximum_volume_size: Option<Int64Value>,
}

/// `ControllerServiceCapability.RPC.Type` values.
pub mod controller_rpc {
    pub const CREATE_DELETE_VOLUME: i32 = 1;
    pub const PUBLISH_UNPUBLISH_VOLUME: i32 = 2;
    pub const LIST_VOLUMES: i32 = 3;
    pub const GET_CAPACITY: i32 = 4;
    pub const EXPAND_VOLUME: i32 = 9;
    pub const LIST_VOLUMES_PUBLISHED_NODES: i32 = 10;
}

/// `NodeServiceCapability.RPC.Type` values.
pub mod node_rpc {
    pub const STAGE_UNSTAGE_VOLUME: i32 = 1;
    pub const GET_VOLUME_STATS: i32 = 2;
    pub const EXPAND_VOLUME: i32 = 3;
}

/// A controller or node capability: `oneof type { RPC rpc = 1; }`.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct RpcCapability {
    #[prost(message, optional, tag = "1")]
    pub rpc: Option<TypeOnly>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct CapabilitiesResponse {
    #[prost(message, repeated, tag = "1")]
    pub capabilities: Vec<RpcCapability>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ControllerExpandVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(message, optional, tag = "2")]
    pub capacity_range: Option<CapacityRange>,
    #[prost(message, optional, tag = "4")]
    pub volume_capability: Option<VolumeCapability>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct ControllerExpandVolumeResponse {
    #[prost(int64, tag = "1")]
    pub capacity_bytes: i64,
    #[prost(bool, tag = "2")]
    pub node_expansion_required: bool,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeStageVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(map = "string, string", tag = "2")]
    pub publish_context: Map,
    #[prost(string, tag = "3")]
    pub staging_target_path: String,
    #[prost(message, optional, tag = "4")]
    pub volume_capability: Option<VolumeCapability>,
    #[prost(map = "string, string", tag = "5")]
    pub secrets: Map,
    #[prost(map = "string, string", tag = "6")]
    pub volume_context: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeUnstageVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(string, tag = "2")]
    pub staging_target_path: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodePublishVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(map = "string, string", tag = "2")]
    pub publish_context: Map,
    #[prost(string, tag = "3")]
    pub staging_target_path: String,
    #[prost(string, tag = "4")]
    pub target_path: String,
    #[prost(message, optional, tag = "5")]
    pub volume_capability: Option<VolumeCapability>,
    #[prost(bool, tag = "6")]
    pub readonly: bool,
    #[prost(map = "string, string", tag = "8")]
    pub volume_context: Map,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeUnpublishVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(string, tag = "2")]
    pub target_path: String,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeGetVolumeStatsRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(string, tag = "2")]
    pub volume_path: String,
    #[prost(string, tag = "3")]
    pub staging_target_path: String,
}

/// `VolumeUsage.Unit.BYTES`.
pub const UNIT_BYTES: i32 = 1;
/// `VolumeUsage.Unit.INODES`.
pub const UNIT_INODES: i32 = 2;

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct VolumeUsage {
    #[prost(int64, tag = "1")]
    pub available: i64,
    #[prost(int64, tag = "2")]
    pub total: i64,
    #[prost(int64, tag = "3")]
    pub used: i64,
    #[prost(int32, tag = "4")]
    pub unit: i32,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeGetVolumeStatsResponse {
    #[prost(message, repeated, tag = "1")]
    pub usage: Vec<VolumeUsage>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeGetInfoResponse {
    #[prost(string, tag = "1")]
    pub node_id: String,
    #[prost(int64, tag = "2")]
    pub max_volumes_per_node: i64,
    #[prost(message, optional, tag = "3")]
    pub accessible_topology: Option<Topology>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeExpandVolumeRequest {
    #[prost(string, tag = "1")]
    pub volume_id: String,
    #[prost(string, tag = "2")]
    pub volume_path: String,
    #[prost(message, optional, tag = "3")]
    pub capacity_range: Option<CapacityRange>,
    #[prost(string, tag = "4")]
    pub staging_target_path: String,
    #[prost(message, optional, tag = "5")]
    pub volume_capability: Option<VolumeCapability>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
pub struct NodeExpandVolumeResponse {
    #[prost(int64, tag = "1")]
    pub capacity_bytes: i64,
}
