//! C declarations of the libibverbs and librdmacm types this crate uses (rdma-core's
//! `infiniband/verbs.h` and `rdma/rdma_cma.h`, stable ABI `IBVERBS_1.1` / `RDMACM_1.0`).
//!
//! Only the leading fields a caller reads are declared for structures the libraries allocate
//! (contexts, queue pairs, CM identifiers, events); structures this crate allocates and passes
//! in (work requests, work completions, attributes) are declared whole. Every size and offset
//! is asserted at compile time against the values of the C headers on 64-bit Linux, and the
//! `layout` integration test compares them with a C compiler's view when the headers are
//! installed.
#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::mem::{offset_of, size_of};

/// Opaque `struct ibv_device`.
#[repr(C)]
pub struct ibv_device {
    _opaque: [u8; 0],
}

/// `struct ibv_context_ops`: the provider's function table; `ibv_post_send`, `ibv_post_recv`,
/// `ibv_poll_cq` and `ibv_req_notify_cq` are static inline functions in verbs.h that call
/// through it.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat: [*mut c_void; 11],
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    pub _compat2: [*mut c_void; 12],
    pub post_send:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub post_recv:
        Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    pub _compat3: [*mut c_void; 5],
}

/// `struct ibv_context` (leading fields).
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
}

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_pd` (leading fields).
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq` (leading fields).
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

/// `struct ibv_qp` (leading fields).
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_send_wr`, with the `wr.rdma` member of the `wr` union spelled out.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// `imm_data` (network order) or `invalidate_rkey`.
    pub imm_or_invalidate_rkey: u32,
    /// `wr.rdma.remote_addr`.
    pub remote_addr: u64,
    /// `wr.rdma.rkey`.
    pub rkey: u32,
    /// The rest of the `wr` union (its `atomic` member is the largest).
    pub _wr_rest: [u32; 5],
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    /// The `bind_mw` / `tso` union.
    pub _tail: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_or_invalidated_rkey: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct rdma_event_channel`.
#[repr(C)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// `struct sockaddr_storage` as embedded in `struct rdma_addr`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct sockaddr_storage128 {
    pub bytes: [u8; 128],
}

/// `struct rdma_cm_id` (leading fields: up to the addresses of its route).
#[repr(C)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    /// `route.addr.src_storage`.
    pub src: sockaddr_storage128,
    /// `route.addr.dst_storage`.
    pub dst: sockaddr_storage128,
}

/// `struct rdma_conn_param`.
#[repr(C)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

/// `struct rdma_cm_event` (with the `conn` member of the `param` union).
#[repr(C)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: c_int,
    pub status: c_int,
    pub conn: rdma_conn_param,
}

// Layout checks against rdma-core's headers on LP64 Linux (x86_64, aarch64, ppc64le).
#[cfg(target_pointer_width = "64")]
const _: () = {
    assert!(size_of::<ibv_context_ops>() == 256);
    assert!(offset_of!(ibv_context_ops, poll_cq) == 88);
    assert!(offset_of!(ibv_context_ops, req_notify_cq) == 96);
    assert!(offset_of!(ibv_context_ops, post_send) == 200);
    assert!(offset_of!(ibv_context_ops, post_recv) == 208);
    assert!(offset_of!(ibv_context, ops) == 8);
    assert!(offset_of!(ibv_context, num_comp_vectors) == 272);
    assert!(size_of::<ibv_device_attr>() == 232);
    assert!(offset_of!(ibv_device_attr, max_qp_wr) == 112);
    assert!(offset_of!(ibv_device_attr, max_sge) == 120);
    assert!(offset_of!(ibv_device_attr, max_cqe) == 132);
    assert!(offset_of!(ibv_device_attr, max_qp_rd_atom) == 144);
    assert!(offset_of!(ibv_device_attr, max_qp_init_rd_atom) == 156);
    assert!(offset_of!(ibv_device_attr, phys_port_cnt) == 227);
    assert!(offset_of!(ibv_pd, handle) == 8);
    assert!(size_of::<ibv_mr>() == 48);
    assert!(offset_of!(ibv_mr, lkey) == 36);
    assert!(offset_of!(ibv_mr, rkey) == 40);
    assert!(size_of::<ibv_comp_channel>() == 16);
    assert!(offset_of!(ibv_comp_channel, fd) == 8);
    assert!(offset_of!(ibv_cq, cqe) == 28);
    assert!(offset_of!(ibv_qp, qp_num) == 52);
    assert!(size_of::<ibv_qp_cap>() == 20);
    assert!(size_of::<ibv_qp_init_attr>() == 64);
    assert!(offset_of!(ibv_qp_init_attr, cap) == 32);
    assert!(offset_of!(ibv_qp_init_attr, qp_type) == 52);
    assert!(offset_of!(ibv_qp_init_attr, sq_sig_all) == 56);
    assert!(size_of::<ibv_sge>() == 16);
    assert!(size_of::<ibv_send_wr>() == 128);
    assert!(offset_of!(ibv_send_wr, opcode) == 28);
    assert!(offset_of!(ibv_send_wr, send_flags) == 32);
    assert!(offset_of!(ibv_send_wr, imm_or_invalidate_rkey) == 36);
    assert!(offset_of!(ibv_send_wr, remote_addr) == 40);
    assert!(offset_of!(ibv_send_wr, rkey) == 48);
    assert!(offset_of!(ibv_send_wr, remote_srqn) == 72);
    assert!(size_of::<ibv_recv_wr>() == 32);
    assert!(size_of::<ibv_wc>() == 48);
    assert!(offset_of!(ibv_wc, byte_len) == 20);
    assert!(offset_of!(ibv_wc, wc_flags) == 36);
    assert!(offset_of!(rdma_cm_id, qp) == 24);
    assert!(offset_of!(rdma_cm_id, src) == 32);
    assert!(offset_of!(rdma_cm_id, dst) == 160);
    assert!(size_of::<rdma_conn_param>() == 24);
    assert!(offset_of!(rdma_conn_param, initiator_depth) == 10);
    assert!(offset_of!(rdma_conn_param, qp_num) == 16);
    assert!(offset_of!(rdma_cm_event, event) == 16);
    assert!(offset_of!(rdma_cm_event, status) == 20);
    assert!(offset_of!(rdma_cm_event, conn) == 24);
};

/// `enum ibv_wc_status`: success.
pub const IBV_WC_SUCCESS: c_int = 0;
/// `enum ibv_wc_status`: the work request was flushed (the queue pair is in the error state).
pub const IBV_WC_WR_FLUSH_ERR: c_int = 5;

/// `enum ibv_wc_opcode` values this crate looks at.
pub const IBV_WC_SEND: c_int = 0;
/// RDMA WRITE completed.
pub const IBV_WC_RDMA_WRITE: c_int = 1;
/// RDMA READ completed.
pub const IBV_WC_RDMA_READ: c_int = 2;
/// A receive completed.
pub const IBV_WC_RECV: c_int = 1 << 7;
/// `wc_flags`: the SEND that was received invalidated a local rkey.
pub const IBV_WC_WITH_INV: c_uint = 1 << 3;

/// `enum ibv_wr_opcode` values.
pub const IBV_WR_RDMA_WRITE: c_uint = 0;
/// SEND.
pub const IBV_WR_SEND: c_uint = 2;
/// RDMA READ.
pub const IBV_WR_RDMA_READ: c_uint = 4;
/// SEND with invalidate.
pub const IBV_WR_SEND_WITH_INV: c_uint = 9;

/// `enum ibv_send_flags`: generate a completion.
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;

/// `enum ibv_access_flags`.
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
/// Remote peers may RDMA WRITE into the region.
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
/// Remote peers may RDMA READ from the region.
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;

/// `enum ibv_qp_type`: reliable connected.
pub const IBV_QPT_RC: c_int = 2;

/// `enum rdma_port_space`: TCP-like, reliable connected.
pub const RDMA_PS_TCP: c_int = 0x0106;

/// `enum rdma_cm_event_type` values.
pub const RDMA_CM_EVENT_ADDR_RESOLVED: c_int = 0;
/// Address resolution failed.
pub const RDMA_CM_EVENT_ADDR_ERROR: c_int = 1;
/// Route resolved.
pub const RDMA_CM_EVENT_ROUTE_RESOLVED: c_int = 2;
/// Route resolution failed.
pub const RDMA_CM_EVENT_ROUTE_ERROR: c_int = 3;
/// A connection request on a listener.
pub const RDMA_CM_EVENT_CONNECT_REQUEST: c_int = 4;
/// A reply on a connection without a queue pair.
pub const RDMA_CM_EVENT_CONNECT_RESPONSE: c_int = 5;
/// Connection failed.
pub const RDMA_CM_EVENT_CONNECT_ERROR: c_int = 6;
/// The peer is unreachable.
pub const RDMA_CM_EVENT_UNREACHABLE: c_int = 7;
/// The peer rejected the connection.
pub const RDMA_CM_EVENT_REJECTED: c_int = 8;
/// The connection is established.
pub const RDMA_CM_EVENT_ESTABLISHED: c_int = 9;
/// The connection was disconnected.
pub const RDMA_CM_EVENT_DISCONNECTED: c_int = 10;
/// The RDMA device was removed.
pub const RDMA_CM_EVENT_DEVICE_REMOVAL: c_int = 11;
/// The address changed.
pub const RDMA_CM_EVENT_ADDR_CHANGE: c_int = 14;
/// The connection left the time-wait state.
pub const RDMA_CM_EVENT_TIMEWAIT_EXIT: c_int = 15;
