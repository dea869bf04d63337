//! GPU memory registration for NVMe/RDMA, the parts a GPU machine without an RDMA NIC can run:
//! a device buffer exported as a dma-buf gives the `ibv_reg_dmabuf_mr` request (fd, offset,
//! length, IOVA, access) the initiator registers, and registering GPU memory on an NVMe/TCP
//! controller is a typed error; the same for the device data areas of GPU request rings
//! (`DataMode::Device`), which attach over NVMe/RDMA only. Every test prints `SKIP <name>: skipped: no CUDA driver ...`
//! and passes on machines without a GPU; with NVMEOF_GPU_REQUIRE=1 that is a failure.
//!
//! On the GPU machine: `NVMEOF_GPU_REQUIRE=1 cargo test -p nvmeof-initiator --test gpu_rdma`.

mod common;

use common::{TestTarget, options};
use nvmeof_initiator::gpu::cuda::{GpuContext, test_support::should_skip};
use nvmeof_initiator::gpu_ring::{DataMode, NsBinding, RingConfig, RingSet};
use nvmeof_initiator::{Controller, DmabufRequest, Error};

/// Opens GPU 0, or prints SKIP and returns None.
fn gpu_or_skip(name: &str) -> Option<GpuContext> {
    match GpuContext::new(0) {
        Ok(ctx) => Some(ctx),
        Err(e) if should_skip(name, &e) => None,
        Err(e) => panic!("{name}: cannot open GPU 0: {e}"),
    }
}

/// `IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ`.
const REMOTE_ACCESS: i32 = 1 | 2 | 4;

#[test]
fn dmabuf_registration_request_of_a_device_buffer() {
    let name = "dmabuf_registration_request_of_a_device_buffer";
    let Some(ctx) = gpu_or_skip(name) else {
        return;
    };
    assert!(
        ctx.info().dma_buf_supported,
        "{name}: the device does not export dma-bufs ({:?})",
        ctx.info()
    );
    let buf = ctx.alloc_exportable(3 << 20).expect("alloc_exportable");
    // A slice that starts and ends inside pages: the export covers the pages around it, and
    // the request's offset says where the slice starts in the dma-buf.
    let start = 4096 + 100;
    let len = (1 << 20) + 12;
    let slice = buf.slice(start..start + len).expect("slice");
    let d = slice.export_dmabuf().expect("export_dmabuf");
    let req = DmabufRequest::for_dmabuf(&d).expect("request");
    println!("{name}: {d:?} -> {req:?}");
    assert!(req.fd >= 0);
    let link = std::fs::read_link(format!("/proc/self/fd/{}", req.fd)).expect("readlink fd");
    assert!(
        link.to_string_lossy().contains("dmabuf"),
        "{name}: fd {} is {link:?}, not a dma-buf",
        req.fd
    );
    assert_eq!(req.len, len);
    assert_eq!(req.iova, slice.device_ptr());
    assert_eq!(req.offset, slice.device_ptr() - d.mapped_start());
    assert_eq!(req.offset, 100);
    assert!(req.offset + req.len as u64 <= d.mapped_len());
    assert_eq!(req.access, REMOTE_ACCESS);
    // The whole buffer: offset 0, its own length, its device address.
    let whole = buf.as_slice().export_dmabuf().expect("export whole");
    let req = DmabufRequest::for_dmabuf(&whole).expect("request");
    assert_eq!(
        (req.offset, req.len, req.iova),
        (0, buf.len(), buf.device_ptr())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_registration_over_tcp_is_a_typed_error() {
    let name = "gpu_registration_over_tcp_is_a_typed_error";
    let Some(ctx) = gpu_or_skip(name) else {
        return;
    };
    let target = TestTarget::start(&["mem:4M"], |_| {});
    let ctrl = Controller::connect(options(target.target_addr()))
        .await
        .expect("connect");
    let buf = ctx.alloc(1 << 20).expect("alloc");
    match ctrl.register_gpu(buf) {
        Err(Error::Unsupported(why)) => {
            assert!(why.contains("NVMe/RDMA"), "{why}");
            assert!(!why.contains('\n'));
        }
        Err(e) => panic!("{name}: expected Error::Unsupported, got {e}"),
        Ok(r) => panic!("{name}: registered GPU memory over NVMe/TCP: {r:?}"),
    }
    // Host memory over TCP still works (plain memory, ordinary reads and writes).
    let ns = ctrl.namespace(1).await.expect("namespace");
    let mut host = ctrl.register_buffer(64 << 10).expect("register_buffer");
    assert!(!host.is_registered());
    host.as_mut_slice().unwrap().fill(0x5A);
    ns.write_registered(0, &mut host, 0, 64 << 10)
        .await
        .expect("write_registered");
    host.as_mut_slice().unwrap().fill(0);
    ns.read_registered(0, &mut host, 0, 64 << 10)
        .await
        .expect("read_registered");
    assert!(host.as_slice().unwrap().iter().all(|&b| b == 0x5A));
    ctrl.disconnect().await.expect("disconnect");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_data_rings_export_as_dmabuf_and_refuse_tcp() {
    let name = "device_data_rings_export_as_dmabuf_and_refuse_tcp";
    let Some(ctx) = gpu_or_skip(name) else {
        return;
    };
    let cfg = RingConfig {
        slots: 16,
        slot_bytes: 4096,
        mode: DataMode::Device,
    };
    let ns = NsBinding {
        nsid: 1,
        block_size: 512,
        blocks: 8192,
    };
    // Each ring's data areas: device memory the descriptor names, exported whole as the
    // dma-buf the NVMe/RDMA attach registers.
    let mut set = RingSet::new_gpu(&ctx, 2, cfg, &[ns]).expect("device-data ring set");
    let descs = set.descriptors();
    let rings = set.take_host_rings();
    for (ring, desc) in rings.iter().zip(&descs) {
        let area = ring.device_data().expect("device data areas");
        assert_eq!(desc.data, area.device_ptr());
        assert_eq!(area.len(), 16 * 4096);
        assert_eq!(ring.data_offset(17), 4096);
        assert!(ring.data_area().is_empty(), "no data areas in host memory");
        let d = area
            .as_slice()
            .export_dmabuf()
            .expect("export the data areas");
        let req = DmabufRequest::for_dmabuf(&d).expect("request");
        assert_eq!(
            (req.offset, req.len, req.iova, req.access),
            (0, 16 * 4096, area.device_ptr(), REMOTE_ACCESS)
        );
    }
    println!(
        "{name}: {} rings, data areas at {:#x?}",
        rings.len(),
        descs.iter().map(|d| d.data).collect::<Vec<_>>()
    );
    // Over NVMe/TCP nothing can write device memory for the target: refused, the set keeps
    // its rings.
    let target = TestTarget::start(&["mem:4M"], |_| {});
    let ctrl = Controller::connect(options(target.target_addr()))
        .await
        .expect("connect");
    let mut set = RingSet::new_gpu(&ctx, 2, cfg, &[ns]).expect("device-data ring set");
    match ctrl.attach_gpu_rings(&mut set).await {
        Err(Error::Unsupported(why)) => {
            assert!(why.contains("NVMe/RDMA"), "{why}");
            assert!(!why.contains('\n'));
        }
        Err(e) => panic!("{name}: expected Error::Unsupported, got {e}"),
        Ok(a) => panic!("{name}: device data rings attached over NVMe/TCP: {a:?}"),
    }
    assert_eq!(
        set.take_host_rings().len(),
        2,
        "the refused set keeps its rings"
    );
    ctrl.disconnect().await.expect("disconnect");
}
