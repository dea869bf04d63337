//! Registered buffers on an NVMe/TCP controller (our target in process, on loopback): the
//! same calls a data loader makes over NVMe/RDMA work on plain memory, split transfers
//! included, and no command counts as registered. (Over NVMe/RDMA the QEMU guest test
//! `tests/tests/initiator_rdma.rs` checks them against the kernel target and ours.)

mod common;

use common::{TestTarget, options};
use nvmeof_initiator::{Controller, Error};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_buffers_over_tcp_read_and_write_like_slices() {
    let target = TestTarget::start(&["mem:8M"], |_| {});
    let mut opts = options(target.target_addr());
    // Small commands, so one call splits into several.
    opts.max_transfer = Some(64 << 10);
    let ctrl = Controller::connect(opts).await.expect("connect");
    let ns = ctrl.namespace(1).await.expect("namespace");
    let len = (1 << 20) + 4096;
    let mut buf = ctrl.register_buffer(len).expect("register_buffer");
    assert!(!buf.is_registered());
    assert_eq!(buf.len(), len);
    let want: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
    buf.as_mut_slice().unwrap().copy_from_slice(&want);
    ns.write_registered(8, &mut buf, 0, len)
        .await
        .expect("write_registered");
    let mut plain = vec![0u8; len];
    ns.read(8, &mut plain).await.expect("read");
    assert!(plain == want, "an ordinary read differs");
    buf.as_mut_slice().unwrap().fill(0);
    ns.read_registered(8, &mut buf, 0, len)
        .await
        .expect("read_registered");
    assert!(buf.as_slice().unwrap() == &want[..]);
    // A sub-range into the middle of the buffer.
    buf.as_mut_slice().unwrap()[8192..16384].fill(0);
    let bs = u64::from(ns.block_size());
    ns.read_registered(8 + 8192 / bs, &mut buf, 8192, 8192)
        .await
        .expect("read_registered sub-range");
    assert!(buf.as_slice().unwrap() == &want[..]);
    // Ranges outside the buffer and lengths that are not whole blocks are refused.
    for (off, n) in [(len - 4096, 8192), (usize::MAX, 4096), (0, 100)] {
        let e = ns.read_registered(0, &mut buf, off, n).await.unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    assert!(ctrl.register_buffer(0).is_err());
    let stats = ctrl.queue_stats();
    assert!(stats.iter().all(|s| s.registered_commands == 0));
    ctrl.disconnect().await.expect("disconnect");
}
