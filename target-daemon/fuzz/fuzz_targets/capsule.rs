//! Arbitrary command capsules through the target's queue logic: Connect handling, the admin
//! command set, I/O validation, and execution against a memory namespace. Any panic is a bug.
#![no_main]

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use futures_util::FutureExt;
use libfuzzer_sys::fuzz_target;
use nvme_spec::fabrics::{Cc, ConnectData, property};
use nvme_spec::{FabricsCommand, IntoBytes, SglDescriptor, Sqe};
use nvmeof_target::Target;
use nvmeof_target::config::Config;
use nvmeof_target::controller::QueueOrigin;
use nvmeof_target::queue::{QueueState, Submit};

const NQN: &str = "nqn.2026-11.io.nvmeof-direct:fuzz";
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:fuzz";

fn target() -> &'static Arc<Target> {
    static T: OnceLock<Arc<Target>> = OnceLock::new();
    T.get_or_init(|| {
        let cfg = Config::quick(
            &["tcp://127.0.0.1:0".parse().unwrap()],
            NQN,
            &["mem:4M".parse().unwrap()],
            true,
            &[],
        )
        .unwrap();
        Target::build(&cfg).unwrap().0
    })
}

fn run(q: &mut QueueState, sqe: &Sqe, data: &[u8]) {
    if let Submit::Io(req) = q.submit(sqe, data) {
        let Some(ctrl) = q.ctrl.clone() else { return };
        let len = req.op.host_data_len().max(match req.op {
            nvmeof_target::queue::IoOp::Read { len, .. } => len,
            nvmeof_target::queue::IoOp::Write { len, .. } => len,
            _ => 0,
        });
        let mut buf = blockdev::IoBuf::new(len);
        let n = data.len().min(len);
        buf[..n].copy_from_slice(&data[..n]);
        let _ = nvmeof_target::io::execute(&ctrl, &req, buf).now_or_never();
    }
}

fn connect(q: &mut QueueState, qid: u16, cntlid: u16) {
    let mut sqe = FabricsCommand::Connect(nvme_spec::command::Connect {
        recfmt: 0,
        qid,
        sqsize: 32,
        cattr: 0,
        kato_ms: 0,
    })
    .encode(0);
    sqe.dptr = SglDescriptor::in_capsule(1024);
    run(q, &sqe, ConnectData::new([1; 16], cntlid, NQN, HOST).as_bytes());
}

fuzz_target!(|input: &[u8]| {
    let t = Arc::clone(target());
    let origin = QueueOrigin {
        local: SocketAddr::from(([127, 0, 0, 1], 4420)),
        peer: SocketAddr::from(([127, 0, 0, 1], 40000)),
    };
    // An admin queue connected and enabled, and an I/O queue of the same controller.
    let mut admin = QueueState::new(Arc::clone(&t), origin);
    let mut io = QueueState::new(Arc::clone(&t), origin);
    let mut fresh = QueueState::new(Arc::clone(&t), origin);
    if input.first().is_some_and(|b| b & 1 == 1) {
        connect(&mut admin, 0, 0xFFFF);
        if let Some(ctrl) = admin.ctrl.clone() {
            let cc = FabricsCommand::PropertySet {
                size8: false,
                offset: property::CC,
                value: u64::from(Cc::enable_value()),
            }
            .encode(1);
            run(&mut admin, &cc, &[]);
            run(&mut admin, &nvme_spec::command::build::set_features(2, 7, 0x0001_0001), &[]);
            connect(&mut io, 1, ctrl.cntlid);
        }
    }
    // Then records: selector byte, 64-byte SQE, length byte (x16 bytes of data), data.
    let mut rest = input.get(1..).unwrap_or(&[]);
    while rest.len() >= 66 {
        let sel = rest[0];
        let raw: [u8; 64] = rest[1..65].try_into().unwrap();
        let dlen = (usize::from(rest[65]) * 16).min(rest.len() - 66);
        let data = &rest[66..66 + dlen];
        rest = &rest[66 + dlen..];
        let sqe = Sqe::from_array(&raw);
        let q = match sel % 3 {
            0 => &mut admin,
            1 => &mut io,
            _ => &mut fresh,
        };
        run(q, &sqe, data);
    }
    if let Some(c) = admin.ctrl.take() {
        c.tear_down();
    }
});
