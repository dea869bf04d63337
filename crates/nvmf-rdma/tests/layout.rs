//! The declarations in `nvmf_rdma::sys` against a C compiler's view of rdma-core's headers.
//!
//! Needs a C compiler and the headers (`libibverbs-dev`, `librdmacm-dev`; scripts/test.sh
//! installs them); without them the test prints why it did nothing. The compile-time asserts
//! in sys.rs hold the same numbers, so a mismatch with an installed rdma-core shows here.

use std::mem::{offset_of, size_of};
use std::path::Path;
use std::process::Command;

use nvmf_rdma::sys::*;

/// (C expression, value in Rust).
fn rust_layout() -> Vec<(&'static str, usize)> {
    vec![
        (
            "sizeof(struct ibv_context_ops)",
            size_of::<ibv_context_ops>(),
        ),
        (
            "offsetof(struct ibv_context_ops, poll_cq)",
            offset_of!(ibv_context_ops, poll_cq),
        ),
        (
            "offsetof(struct ibv_context_ops, req_notify_cq)",
            offset_of!(ibv_context_ops, req_notify_cq),
        ),
        (
            "offsetof(struct ibv_context_ops, post_send)",
            offset_of!(ibv_context_ops, post_send),
        ),
        (
            "offsetof(struct ibv_context_ops, post_recv)",
            offset_of!(ibv_context_ops, post_recv),
        ),
        (
            "offsetof(struct ibv_context, ops)",
            offset_of!(ibv_context, ops),
        ),
        (
            "offsetof(struct ibv_context, num_comp_vectors)",
            offset_of!(ibv_context, num_comp_vectors),
        ),
        (
            "sizeof(struct ibv_device_attr)",
            size_of::<ibv_device_attr>(),
        ),
        (
            "offsetof(struct ibv_device_attr, max_mr_size)",
            offset_of!(ibv_device_attr, max_mr_size),
        ),
        (
            "offsetof(struct ibv_device_attr, max_qp_wr)",
            offset_of!(ibv_device_attr, max_qp_wr),
        ),
        (
            "offsetof(struct ibv_device_attr, max_sge)",
            offset_of!(ibv_device_attr, max_sge),
        ),
        (
            "offsetof(struct ibv_device_attr, max_cqe)",
            offset_of!(ibv_device_attr, max_cqe),
        ),
        (
            "offsetof(struct ibv_device_attr, max_qp_rd_atom)",
            offset_of!(ibv_device_attr, max_qp_rd_atom),
        ),
        (
            "offsetof(struct ibv_device_attr, max_qp_init_rd_atom)",
            offset_of!(ibv_device_attr, max_qp_init_rd_atom),
        ),
        (
            "offsetof(struct ibv_device_attr, phys_port_cnt)",
            offset_of!(ibv_device_attr, phys_port_cnt),
        ),
        (
            "offsetof(struct ibv_pd, handle)",
            offset_of!(ibv_pd, handle),
        ),
        ("sizeof(struct ibv_mr)", size_of::<ibv_mr>()),
        ("offsetof(struct ibv_mr, lkey)", offset_of!(ibv_mr, lkey)),
        ("offsetof(struct ibv_mr, rkey)", offset_of!(ibv_mr, rkey)),
        (
            "sizeof(struct ibv_comp_channel)",
            size_of::<ibv_comp_channel>(),
        ),
        (
            "offsetof(struct ibv_comp_channel, fd)",
            offset_of!(ibv_comp_channel, fd),
        ),
        (
            "offsetof(struct ibv_cq, context)",
            offset_of!(ibv_cq, context),
        ),
        ("offsetof(struct ibv_cq, cqe)", offset_of!(ibv_cq, cqe)),
        (
            "offsetof(struct ibv_qp, context)",
            offset_of!(ibv_qp, context),
        ),
        (
            "offsetof(struct ibv_qp, qp_num)",
            offset_of!(ibv_qp, qp_num),
        ),
        ("sizeof(struct ibv_qp_cap)", size_of::<ibv_qp_cap>()),
        (
            "sizeof(struct ibv_qp_init_attr)",
            size_of::<ibv_qp_init_attr>(),
        ),
        (
            "offsetof(struct ibv_qp_init_attr, cap)",
            offset_of!(ibv_qp_init_attr, cap),
        ),
        (
            "offsetof(struct ibv_qp_init_attr, qp_type)",
            offset_of!(ibv_qp_init_attr, qp_type),
        ),
        (
            "offsetof(struct ibv_qp_init_attr, sq_sig_all)",
            offset_of!(ibv_qp_init_attr, sq_sig_all),
        ),
        ("sizeof(struct ibv_sge)", size_of::<ibv_sge>()),
        ("sizeof(struct ibv_send_wr)", size_of::<ibv_send_wr>()),
        (
            "offsetof(struct ibv_send_wr, sg_list)",
            offset_of!(ibv_send_wr, sg_list),
        ),
        (
            "offsetof(struct ibv_send_wr, opcode)",
            offset_of!(ibv_send_wr, opcode),
        ),
        (
            "offsetof(struct ibv_send_wr, send_flags)",
            offset_of!(ibv_send_wr, send_flags),
        ),
        (
            "offsetof(struct ibv_send_wr, invalidate_rkey)",
            offset_of!(ibv_send_wr, imm_or_invalidate_rkey),
        ),
        (
            "offsetof(struct ibv_send_wr, wr.rdma.remote_addr)",
            offset_of!(ibv_send_wr, remote_addr),
        ),
        (
            "offsetof(struct ibv_send_wr, wr.rdma.rkey)",
            offset_of!(ibv_send_wr, rkey),
        ),
        (
            "offsetof(struct ibv_send_wr, qp_type.xrc.remote_srqn)",
            offset_of!(ibv_send_wr, remote_srqn),
        ),
        ("sizeof(struct ibv_recv_wr)", size_of::<ibv_recv_wr>()),
        (
            "offsetof(struct ibv_recv_wr, num_sge)",
            offset_of!(ibv_recv_wr, num_sge),
        ),
        ("sizeof(struct ibv_wc)", size_of::<ibv_wc>()),
        (
            "offsetof(struct ibv_wc, status)",
            offset_of!(ibv_wc, status),
        ),
        (
            "offsetof(struct ibv_wc, vendor_err)",
            offset_of!(ibv_wc, vendor_err),
        ),
        (
            "offsetof(struct ibv_wc, byte_len)",
            offset_of!(ibv_wc, byte_len),
        ),
        (
            "offsetof(struct ibv_wc, wc_flags)",
            offset_of!(ibv_wc, wc_flags),
        ),
        (
            "offsetof(struct rdma_event_channel, fd)",
            offset_of!(rdma_event_channel, fd),
        ),
        (
            "offsetof(struct rdma_cm_id, verbs)",
            offset_of!(rdma_cm_id, verbs),
        ),
        (
            "offsetof(struct rdma_cm_id, qp)",
            offset_of!(rdma_cm_id, qp),
        ),
        (
            "offsetof(struct rdma_cm_id, route.addr.src_addr)",
            offset_of!(rdma_cm_id, src),
        ),
        (
            "offsetof(struct rdma_cm_id, route.addr.dst_addr)",
            offset_of!(rdma_cm_id, dst),
        ),
        (
            "sizeof(struct rdma_conn_param)",
            size_of::<rdma_conn_param>(),
        ),
        (
            "offsetof(struct rdma_conn_param, private_data_len)",
            offset_of!(rdma_conn_param, private_data_len),
        ),
        (
            "offsetof(struct rdma_conn_param, responder_resources)",
            offset_of!(rdma_conn_param, responder_resources),
        ),
        (
            "offsetof(struct rdma_conn_param, initiator_depth)",
            offset_of!(rdma_conn_param, initiator_depth),
        ),
        (
            "offsetof(struct rdma_conn_param, rnr_retry_count)",
            offset_of!(rdma_conn_param, rnr_retry_count),
        ),
        (
            "offsetof(struct rdma_conn_param, qp_num)",
            offset_of!(rdma_conn_param, qp_num),
        ),
        (
            "offsetof(struct rdma_cm_event, event)",
            offset_of!(rdma_cm_event, event),
        ),
        (
            "offsetof(struct rdma_cm_event, status)",
            offset_of!(rdma_cm_event, status),
        ),
        (
            "offsetof(struct rdma_cm_event, param.conn)",
            offset_of!(rdma_cm_event, conn),
        ),
        // Enumerations and flags.
        ("IBV_WC_SUCCESS", IBV_WC_SUCCESS as usize),
        ("IBV_WC_WR_FLUSH_ERR", IBV_WC_WR_FLUSH_ERR as usize),
        ("IBV_WC_SEND", IBV_WC_SEND as usize),
        ("IBV_WC_RDMA_WRITE", IBV_WC_RDMA_WRITE as usize),
        ("IBV_WC_RDMA_READ", IBV_WC_RDMA_READ as usize),
        ("IBV_WC_RECV", IBV_WC_RECV as usize),
        ("IBV_WC_WITH_INV", IBV_WC_WITH_INV as usize),
        ("IBV_WR_RDMA_WRITE", IBV_WR_RDMA_WRITE as usize),
        ("IBV_WR_SEND", IBV_WR_SEND as usize),
        ("IBV_WR_RDMA_READ", IBV_WR_RDMA_READ as usize),
        ("IBV_WR_SEND_WITH_INV", IBV_WR_SEND_WITH_INV as usize),
        ("IBV_SEND_SIGNALED", IBV_SEND_SIGNALED as usize),
        ("IBV_ACCESS_LOCAL_WRITE", IBV_ACCESS_LOCAL_WRITE as usize),
        ("IBV_ACCESS_REMOTE_WRITE", IBV_ACCESS_REMOTE_WRITE as usize),
        ("IBV_ACCESS_REMOTE_READ", IBV_ACCESS_REMOTE_READ as usize),
        ("IBV_QPT_RC", IBV_QPT_RC as usize),
        ("RDMA_PS_TCP", RDMA_PS_TCP as usize),
        (
            "RDMA_CM_EVENT_ADDR_RESOLVED",
            RDMA_CM_EVENT_ADDR_RESOLVED as usize,
        ),
        (
            "RDMA_CM_EVENT_ROUTE_RESOLVED",
            RDMA_CM_EVENT_ROUTE_RESOLVED as usize,
        ),
        (
            "RDMA_CM_EVENT_CONNECT_REQUEST",
            RDMA_CM_EVENT_CONNECT_REQUEST as usize,
        ),
        ("RDMA_CM_EVENT_REJECTED", RDMA_CM_EVENT_REJECTED as usize),
        (
            "RDMA_CM_EVENT_ESTABLISHED",
            RDMA_CM_EVENT_ESTABLISHED as usize,
        ),
        (
            "RDMA_CM_EVENT_DISCONNECTED",
            RDMA_CM_EVENT_DISCONNECTED as usize,
        ),
        (
            "RDMA_CM_EVENT_DEVICE_REMOVAL",
            RDMA_CM_EVENT_DEVICE_REMOVAL as usize,
        ),
        (
            "RDMA_CM_EVENT_TIMEWAIT_EXIT",
            RDMA_CM_EVENT_TIMEWAIT_EXIT as usize,
        ),
    ]
}

#[test]
fn declarations_match_rdma_core_headers() {
    let rust = rust_layout();
    let headers = [
        "/usr/include/infiniband/verbs.h",
        "/usr/include/rdma/rdma_cma.h",
    ];
    if let Some(h) = headers.iter().find(|h| !Path::new(h).exists()) {
        eprintln!("skipped: {h} missing (apt-get install libibverbs-dev librdmacm-dev)");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let mut src = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\n#include <rdma/rdma_cma.h>\nint main(void) {\n",
    );
    for (expr, _) in &rust {
        src.push_str(&format!("    printf(\"%zu\\n\", (size_t)({expr}));\n"));
    }
    src.push_str("    return 0;\n}\n");
    let c = dir.path().join("layout.c");
    let exe = dir.path().join("layout");
    std::fs::write(&c, src).expect("write C source");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = match Command::new(&cc).arg(&c).arg("-o").arg(&exe).output() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("skipped: no C compiler ({cc}: {e})");
            return;
        }
    };
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let out = Command::new(&exe).output().expect("run layout program");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let values: Vec<usize> = text.lines().map(|l| l.parse().expect("number")).collect();
    assert_eq!(values.len(), rust.len());
    let wrong: Vec<String> = rust
        .iter()
        .zip(&values)
        .filter(|((_, r), c)| r != *c)
        .map(|((e, r), c)| format!("{e}: C {c}, Rust {r}"))
        .collect();
    assert!(
        wrong.is_empty(),
        "layout differs from the headers:\n{}",
        wrong.join("\n")
    );
}
