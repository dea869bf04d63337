//! What a controller and its namespaces report, in a form for programs and for JSON output.

use nvme_spec::identify::{
    IdentifyController, IdentifyNamespace, ONCS_DSM, ONCS_WRITE_ZEROES, decode_ns_descriptors,
    get_trimmed, nidt,
};
use serde::{Deserialize, Serialize};

/// A connected controller, as the host sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerInfo {
    /// Target address (`HOST:PORT`).
    pub addr: String,
    /// Subsystem NQN (from Identify Controller).
    pub subnqn: String,
    /// Host NQN used.
    pub hostnqn: String,
    /// Host identifier used (UUID).
    pub hostid: String,
    /// Controller ID.
    pub cntlid: u16,
    /// Model number.
    pub model: String,
    /// Serial number.
    pub serial: String,
    /// Firmware revision.
    pub firmware: String,
    /// NVMe version (`major.minor[.tertiary]`).
    pub version: String,
    /// `io`, `discovery` or `unknown`.
    pub controller_type: String,
    /// Maximum data transfer size in bytes (`None`: no limit reported).
    pub mdts_bytes: Option<u64>,
    /// Largest transfer per command this host uses, in bytes.
    pub max_transfer_bytes: u32,
    /// Largest write sent inside the command capsule on I/O queues, in bytes.
    pub in_capsule_data_bytes: u32,
    /// Number of I/O queues in use.
    pub io_queues: u16,
    /// Entries per I/O queue.
    pub queue_depth: u16,
    /// Maximum queue entries the controller supports (CAP.MQES + 1).
    pub max_queue_entries: u32,
    /// Keep alive timeout in milliseconds (0: none).
    pub kato_ms: u32,
    /// Header digests in use.
    pub header_digest: bool,
    /// Data digests in use.
    pub data_digest: bool,
    /// SQ flow control in force on the queues (off when the controller took
    /// [`ConnectOptions::disable_sq_flow_control`](crate::ConnectOptions::disable_sq_flow_control)).
    #[serde(default = "sq_flow_control_default")]
    pub sq_flow_control: bool,
    /// Number of namespaces (highest NSID).
    pub nn: u32,
    /// Write Zeroes supported.
    pub write_zeroes: bool,
    /// Dataset Management (deallocate) supported.
    pub dataset_management: bool,
    /// A volatile write cache is present (Flush makes writes durable).
    pub volatile_write_cache: bool,
}

/// What a [`ControllerInfo`] written before `sq_flow_control` existed meant: flow control on.
fn sq_flow_control_default() -> bool {
    true
}

/// A namespace, as Identify Namespace describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceInfo {
    /// Namespace ID.
    pub nsid: u32,
    /// Size in logical blocks.
    pub blocks: u64,
    /// Capacity in logical blocks.
    pub capacity_blocks: u64,
    /// Logical blocks in use.
    pub utilization_blocks: u64,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Metadata bytes per block.
    pub metadata_size: u16,
    /// Namespace GUID (hex, empty when zero).
    pub nguid: String,
    /// IEEE EUI-64 (hex, empty when zero).
    pub eui64: String,
    /// Namespace UUID from the descriptor list, when reported.
    pub uuid: Option<String>,
}

/// Formats a byte string as lowercase hex; empty when all bytes are zero.
pub fn hex_id(b: &[u8]) -> String {
    if b.iter().all(|&x| x == 0) {
        return String::new();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Formats an NVMe version register value.
pub fn version_string(vs: u32) -> String {
    let (major, minor, ter) = (vs >> 16, (vs >> 8) & 0xFF, vs & 0xFF);
    if ter == 0 {
        format!("{major}.{minor}")
    } else {
        format!("{major}.{minor}.{ter}")
    }
}

pub(crate) fn controller_type(t: u8) -> &'static str {
    match t {
        1 => "io",
        2 => "discovery",
        3 => "administrative",
        _ => "unknown",
    }
}

/// Fields of [`ControllerInfo`] that come from Identify Controller.
pub(crate) fn fill_from_identify(info: &mut ControllerInfo, id: &IdentifyController) {
    let oncs = id.oncs.get();
    info.subnqn = get_trimmed(&id.subnqn);
    info.cntlid = id.cntlid.get();
    info.model = get_trimmed(&id.mn);
    info.serial = get_trimmed(&id.sn);
    info.firmware = get_trimmed(&id.fr);
    info.controller_type = controller_type(id.cntrltype).to_string();
    info.nn = id.nn.get();
    info.write_zeroes = oncs & ONCS_WRITE_ZEROES != 0;
    info.dataset_management = oncs & ONCS_DSM != 0;
    info.volatile_write_cache = id.vwc & 1 != 0;
}

/// Builds a [`NamespaceInfo`] from Identify Namespace and an optional descriptor list.
/// Returns `None` for an inactive namespace (all zero) or an unusable LBA format.
pub(crate) fn namespace_info(
    nsid: u32,
    id: &IdentifyNamespace,
    descriptors: Option<&[u8]>,
) -> Option<NamespaceInfo> {
    let block_size = id.block_size();
    if id.nsze.get() == 0 || block_size == 0 {
        return None;
    }
    let idx = usize::from(id.flbas & 0xF);
    let uuid = descriptors.and_then(|d| {
        decode_ns_descriptors(d)
            .into_iter()
            .find(|(t, v)| *t == nidt::UUID && v.len() == 16)
            .and_then(|(_, v)| <[u8; 16]>::try_from(v.as_slice()).ok())
            .map(|b| uuid::Uuid::from_bytes(b).hyphenated().to_string())
    });
    Some(NamespaceInfo {
        nsid,
        blocks: id.nsze.get(),
        capacity_blocks: id.ncap.get(),
        utilization_blocks: id.nuse.get(),
        block_size,
        size_bytes: id.nsze.get().saturating_mul(u64::from(block_size)),
        metadata_size: id.lbaf[idx].ms.get(),
        nguid: hex_id(&id.nguid),
        eui64: hex_id(&id.eui64),
        uuid,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatting() {
        assert_eq!(version_string(0x0001_0400), "1.4");
        assert_eq!(version_string(0x0002_0001), "2.0.1");
        assert_eq!(hex_id(&[0, 0]), "");
        assert_eq!(hex_id(&[0xab, 1]), "ab01");
    }

    #[test]
    fn namespace_from_identify() {
        let mut n = IdentifyNamespace::zeroed();
        assert!(namespace_info(1, &n, None).is_none());
        n.nsze.set(16);
        n.ncap.set(16);
        n.lbaf[0].lbads = 9;
        let desc = nvme_spec::identify::encode_ns_descriptors(&[(nidt::UUID, &[0x11; 16])]);
        let i = namespace_info(3, &n, Some(&desc)).unwrap();
        assert_eq!((i.nsid, i.block_size, i.size_bytes), (3, 512, 8192));
        assert_eq!(
            i.uuid.as_deref(),
            Some("11111111-1111-1111-1111-111111111111")
        );
    }
}
