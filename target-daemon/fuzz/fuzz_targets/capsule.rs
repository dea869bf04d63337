//! Arbitrary command capsules through the target's command engine, by the entry point every
//! transport uses: Connect handling, the admin command set, I/O validation, data fetched from
//! the host, and execution against a memory namespace (the inline read path too). Any panic
//! is a bug.
#![no_main]

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use blockdev::{IoBuf, SharedPiece};
use libfuzzer_sys::fuzz_target;
use nvme_spec::fabrics::{Cc, ConnectData, property};
use nvme_spec::{Cqe, FabricsCommand, IntoBytes, SglDescriptor, Sqe};
use nvmeof_target::Target;
use nvmeof_target::config::Config;
use nvmeof_target::controller::QueueOrigin;
use nvmeof_target::engine::{Engine, Fault, Refused, Step, Transport};
use nvmeof_target::queue::QueueState;

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
        Target::build(&cfg).unwrap()
    })
}

/// A transport that sends nothing: the data goes nowhere, written in place in pieces of
/// 8 KiB or sent from namespace memory from 32 KiB as NVMe/TCP does.
#[derive(Default)]
struct Wire {
    capsule: Vec<u8>,
    out: Vec<u8>,
}

impl Transport for Wire {
    type Tag = Sqe;

    fn sqe<'a>(&'a self, tag: &'a Sqe) -> &'a Sqe {
        tag
    }

    fn capsule(&self, _: &Sqe) -> &[u8] {
        &self.capsule
    }

    fn buffer(&mut self, _: &Sqe, len: usize, from_capsule: bool) -> Result<IoBuf, Fault> {
        let mut b = IoBuf::new(len);
        if from_capsule {
            b.copy_from_slice(&self.capsule);
        }
        Ok(b)
    }

    fn respond(&mut self, _: Sqe, _: &[u8], _: &Cqe) -> Result<(), Refused<Sqe>> {
        Ok(())
    }

    fn send_read(&mut self, _: Sqe, _: IoBuf, _: &Cqe, _: bool) -> Result<(), Refused<Sqe>> {
        Ok(())
    }

    fn recycle(&mut self, _: &Sqe, _: IoBuf) {}

    fn complete_held(&mut self, _: &Cqe) {}

    fn send_read_with<E>(
        &mut self,
        _: &Sqe,
        len: usize,
        align: usize,
        in_data: bool,
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Option<Result<bool, E>> {
        const PIECE: usize = 8192;
        if PIECE % align != 0 {
            return None;
        }
        self.out.resize(len, 0);
        for (i, chunk) in self.out.chunks_mut(PIECE).enumerate() {
            if let Err(e) = fill(i * PIECE, chunk) {
                return Some(Err(e));
            }
        }
        Some(Ok(in_data))
    }

    fn shared_read_min(&self) -> usize {
        32 * 1024
    }

    fn send_read_shared(&mut self, _: &Sqe, _: usize, in_data: bool, _: &[SharedPiece]) -> bool {
        in_data
    }
}

/// Hands `sqe` to the engine with `data` in its capsule, or fetched from the host when the
/// engine asks for it.
fn run(e: &mut Engine<Sqe>, w: &mut Wire, sqe: &Sqe, data: &[u8]) {
    w.capsule.clear();
    w.capsule.extend_from_slice(data);
    if let Step::Fetch(f) = e.command(w, *sqe) {
        let mut buf = IoBuf::new(f.len());
        let n = data.len().min(f.len());
        buf[..n].copy_from_slice(&data[..n]);
        let _ = e.fetched(w, f, buf);
    }
}

fn engine(q: QueueState) -> Engine<Sqe> {
    let gate = target().listener_gate("tcp://127.0.0.1:4420".parse().unwrap());
    Engine::new(q, gate.admit().expect("a connection slot"))
}

fn connect(e: &mut Engine<Sqe>, w: &mut Wire, qid: u16, cntlid: u16) {
    let mut sqe = FabricsCommand::Connect(nvme_spec::command::Connect {
        recfmt: 0,
        qid,
        sqsize: 32,
        cattr: 0,
        kato_ms: 0,
    })
    .encode(0);
    sqe.dptr = SglDescriptor::in_capsule(1024);
    run(e, w, &sqe, ConnectData::new([1; 16], cntlid, NQN, HOST).as_bytes());
}

fuzz_target!(|input: &[u8]| {
    let t = Arc::clone(target());
    let origin = QueueOrigin {
        local: SocketAddr::from(([127, 0, 0, 1], 4420)),
        peer: SocketAddr::from(([127, 0, 0, 1], 40000)),
    };
    // An admin queue connected and enabled, and an I/O queue of the same controller.
    let mut w = Wire::default();
    let mut admin = engine(QueueState::new(Arc::clone(&t), origin));
    let mut io = engine(QueueState::new(Arc::clone(&t), origin));
    let mut fresh = engine(QueueState::new(Arc::clone(&t), origin));
    if input.first().is_some_and(|b| b & 1 == 1) {
        connect(&mut admin, &mut w, 0, 0xFFFF);
        if let Some(ctrl) = admin.q.ctrl.clone() {
            let cc = FabricsCommand::PropertySet {
                size8: false,
                offset: property::CC,
                value: u64::from(Cc::enable_value()),
            }
            .encode(1);
            run(&mut admin, &mut w, &cc, &[]);
            let sf = nvme_spec::command::build::set_features(2, 7, 0x0001_0001);
            run(&mut admin, &mut w, &sf, &[]);
            connect(&mut io, &mut w, 1, ctrl.cntlid);
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
        let e = match sel % 3 {
            0 => &mut admin,
            1 => &mut io,
            _ => &mut fresh,
        };
        run(e, &mut w, &sqe, data);
    }
    if let Some(c) = admin.q.ctrl.take() {
        c.tear_down();
    }
});
