//! Helpers of the crate's unit tests: a target with chosen namespaces and queues connected
//! through the command layer, no sockets.

use std::net::SocketAddr;
use std::sync::Arc;

use blockdev::IoBuf;
use nvme_spec::command::build;
use nvme_spec::fabrics::{Cc, ConnectData, property};
use nvme_spec::queue::SglDescriptor;
use nvme_spec::{Cqe, FabricsCommand, IntoBytes, Sqe, Status};

use crate::config::Config;
use crate::controller::QueueOrigin;
use crate::engine::{Fault, Refused, Transport};
use crate::launcher::RunningTarget;
use crate::queue::{HostSgl, QueueState, Submit};
use crate::reconfigure::Registry;
use crate::target::Target;

/// The subsystem of [`target`].
pub const NQN: &str = "nqn.2026-11.io.nvmeof-direct:unit";
/// The host NQN of [`connected`].
pub const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa";

/// The configuration of a target with one subsystem of `namespaces` (backend specs), open to
/// any host.
pub fn config(namespaces: &[&str]) -> Config {
    let ns: Vec<_> = namespaces.iter().map(|n| n.parse().unwrap()).collect();
    Config::quick(&["tcp://127.0.0.1:0".parse().unwrap()], NQN, &ns, true, &[]).unwrap()
}

/// A built target of [`config`].
pub fn target(namespaces: &[&str]) -> Arc<Target> {
    Target::build(&config(namespaces)).unwrap()
}

/// A started target of [`config`] (one reactor) under a [`Registry`]. Needs a tokio runtime.
pub fn registry(namespaces: &[&str]) -> Registry {
    let mut cfg = config(namespaces);
    cfg.target.reactors = 1;
    let t = Target::build(&cfg).unwrap();
    let l = crate::launcher::bind(&cfg).unwrap();
    Registry::new(RunningTarget::start(t, l).unwrap(), cfg)
}

/// The addresses of the test's queues.
pub fn origin() -> QueueOrigin {
    QueueOrigin {
        local: SocketAddr::from(([10, 0, 2, 15], 4420)),
        peer: SocketAddr::from(([10, 0, 2, 15], 40000)),
    }
}

/// A Fabrics Connect of queue `qid` whose data is keyed (host memory) or in the capsule.
pub fn connect_sqe(qid: u16, keyed: bool) -> Sqe {
    let mut sqe = FabricsCommand::Connect(nvme_spec::command::Connect {
        recfmt: 0,
        qid,
        sqsize: 32,
        cattr: 0,
        kato_ms: 0,
    })
    .encode(0);
    sqe.dptr = if keyed {
        SglDescriptor::keyed(0x1000, 1024, 0x1234, true)
    } else {
        SglDescriptor::in_capsule(1024)
    };
    sqe
}

/// The status a submission answers with at once (success for a request to run).
pub fn status(s: Submit) -> Status {
    match s {
        Submit::Complete(c) | Submit::CompleteAndClose(c) | Submit::CompleteWithData(_, c) => {
            c.status()
        }
        Submit::Held => panic!("held"),
        Submit::Abandon => panic!("abandoned: the controller is gone"),
        Submit::Io(_) => Status::SUCCESS,
    }
}

/// Connects an admin queue (Connect data fetched from host memory on keyed queues, as the
/// Linux host sends it over RDMA), enables the controller, grants queues, and connects I/O
/// queue 1 with in-capsule Connect data.
pub fn connected(t: &Arc<Target>, host_sgl: HostSgl) -> (QueueState, QueueState) {
    connected_as(t, host_sgl, origin(), HOST)
}

/// [`connected`] for host `hostnqn` on a connection to `origin`.
pub fn connected_as(
    t: &Arc<Target>,
    host_sgl: HostSgl,
    origin: QueueOrigin,
    hostnqn: &str,
) -> (QueueState, QueueState) {
    let mut admin = QueueState::new(Arc::clone(t), origin).with_host_sgl(host_sgl);
    let sqe = connect_sqe(0, host_sgl == HostSgl::Keyed);
    let data = ConnectData::new([7; 16], 0xFFFF, NQN, hostnqn);
    assert!(
        admin.wants_data_at_submit(&sqe),
        "Connect data is read at submit"
    );
    assert_eq!(status(admin.submit(&sqe, data.as_bytes())), Status::SUCCESS);
    let ctrl = admin.ctrl.clone().unwrap();
    let cc = FabricsCommand::PropertySet {
        size8: false,
        offset: property::CC,
        value: u64::from(Cc::enable_value()),
    }
    .encode(1);
    assert!(!admin.wants_data_at_submit(&cc));
    assert_eq!(status(admin.submit(&cc, &[])), Status::SUCCESS);
    let sf = build::set_features(2, 7, 0x0001_0001);
    assert_eq!(status(admin.submit(&sf, &[])), Status::SUCCESS);
    let mut io = QueueState::new(Arc::clone(t), origin).with_host_sgl(host_sgl);
    let data = ConnectData::new([7; 16], ctrl.cntlid, NQN, hostnqn);
    let sqe = connect_sqe(1, false);
    assert!(io.wants_data_at_submit(&sqe));
    assert_eq!(status(io.submit(&sqe, data.as_bytes())), Status::SUCCESS);
    (admin, io)
}

/// How the fake transport ([`Wire`]) served a read's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPath {
    /// Written in place ([`crate::engine::Transport::send_read_with`]).
    InPlace,
    /// Sent from namespace memory ([`crate::engine::Transport::send_read_shared`]).
    Shared,
    /// From a buffer the request ran with ([`crate::engine::Transport::send_read`]).
    Buffer,
}

/// The engine's fake transport: keeps what it would send, no sockets.
pub struct Wire {
    /// In-capsule data of the command being handed over.
    pub capsule: Vec<u8>,
    /// Completions, in the order sent.
    pub sent: Vec<Cqe>,
    /// Data sent to the host: (CID, bytes, how).
    pub data: Vec<(u16, Vec<u8>, Option<ReadPath>)>,
    /// Completions that went with their read data.
    pub in_data: usize,
    /// The most a read's data piece written in place holds (0: no reads in place).
    pub piece: usize,
    /// [`crate::engine::Transport::shared_read_min`].
    pub shared_min: usize,
    /// Buffers handed out and not back yet.
    pub buffers_out: usize,
    /// When set, buffers are refused with this fault.
    pub no_buffers: Option<Fault>,
}

impl Default for Wire {
    fn default() -> Self {
        Wire {
            capsule: Vec::new(),
            sent: Vec::new(),
            data: Vec::new(),
            in_data: 0,
            piece: 8192,
            shared_min: 32 * 1024,
            buffers_out: 0,
            no_buffers: None,
        }
    }
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
        if let Some(f) = self.no_buffers {
            return Err(f);
        }
        let mut b = IoBuf::new(len);
        if from_capsule {
            b.copy_from_slice(&self.capsule);
        }
        self.buffers_out += 1;
        Ok(b)
    }

    fn respond(&mut self, _: Sqe, data: &[u8], cqe: &Cqe) -> Result<(), Refused<Sqe>> {
        if !data.is_empty() {
            self.data.push((cqe.cid(), data.to_vec(), None));
        }
        self.sent.push(*cqe);
        Ok(())
    }

    fn send_read(
        &mut self,
        _: Sqe,
        buf: IoBuf,
        cqe: &Cqe,
        in_data: bool,
    ) -> Result<(), Refused<Sqe>> {
        self.buffers_out -= 1;
        self.data
            .push((cqe.cid(), buf.to_vec(), Some(ReadPath::Buffer)));
        if in_data {
            self.in_data += 1;
        } else {
            self.sent.push(*cqe);
        }
        Ok(())
    }

    fn recycle(&mut self, _: &Sqe, buf: IoBuf) {
        if buf.capacity() > 0 {
            self.buffers_out -= 1;
        }
    }

    fn complete_held(&mut self, cqe: &Cqe) {
        self.sent.push(*cqe);
    }

    fn send_read_with<E>(
        &mut self,
        tag: &Sqe,
        len: usize,
        align: usize,
        in_data: bool,
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Option<Result<bool, E>> {
        if self.piece == 0 || self.piece % align != 0 {
            return None;
        }
        let mut out = vec![0; len];
        for (i, chunk) in out.chunks_mut(self.piece).enumerate() {
            if let Err(e) = fill(i * self.piece, chunk) {
                return Some(Err(e));
            }
        }
        self.data.push((tag.cid(), out, Some(ReadPath::InPlace)));
        self.in_data += usize::from(in_data);
        Some(Ok(in_data))
    }

    fn shared_read_min(&self) -> usize {
        self.shared_min
    }

    fn send_read_shared(
        &mut self,
        tag: &Sqe,
        _: usize,
        in_data: bool,
        pieces: &[blockdev::SharedPiece],
    ) -> bool {
        let out = pieces
            .iter()
            .flat_map(|(d, r)| d[r.clone()].iter().copied())
            .collect();
        self.data.push((tag.cid(), out, Some(ReadPath::Shared)));
        self.in_data += usize::from(in_data);
        in_data
    }
}
