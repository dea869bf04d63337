//! An end-to-end check of this crate on a real RDMA device (Soft-RoCE in the interop guest):
//! a listener and a connecting queue on the same address exchange capsules by SEND/RECV, the
//! listening side RDMA READs from and RDMA WRITEs to the connecting side's registered memory
//! (as an NVMe/RDMA target does with a host's keyed SGLs), and a request with an invalid queue
//! ID is rejected with the NVMe reject record.
//!
//!   loopback ADDR:PORT      e.g. loopback 10.0.2.15:4421
//!
//! Prints `LOOPBACK PASS` and exits 0 on success.

use std::net::SocketAddr;
use std::time::Duration;

use nvmf_rdma::nvme::{
    QueueLimits, accept_data, negotiate_ord, parse_accept, parse_reject, parse_request,
    reject_data, request_data,
};
use nvmf_rdma::{
    Access, CapsuleQueue, DataOut, Error, Event, Listener, QueueConfig, RemoteKey, devices,
};

const LIMITS: QueueLimits = QueueLimits {
    max_admin_depth: 32,
    max_io_depth: 64,
    max_qid: 4,
};
const LEN: usize = 256 * 1024;
const ROUNDS: u64 = 64;

type Buf = Box<[u8]>;

/// Command layout (64 bytes): op (1 = fetch from host, 2 = write to host), token, remote key.
fn command(op: u8, token: u64, r: RemoteKey) -> [u8; 64] {
    let mut c = [0u8; 64];
    c[0] = op;
    c[8..16].copy_from_slice(&token.to_le_bytes());
    c[16..24].copy_from_slice(&r.addr.to_le_bytes());
    c[24..28].copy_from_slice(&r.len.to_le_bytes());
    c[28..32].copy_from_slice(&r.rkey.to_le_bytes());
    c
}

fn fail(what: String) -> ! {
    eprintln!("LOOPBACK FAIL: {what}");
    std::process::exit(1);
}

async fn next_events(q: &mut CapsuleQueue<Buf>, out: &mut Vec<Event<Buf>>) {
    loop {
        if let Err(e) = q.poll(out) {
            fail(format!("poll: {e}"));
        }
        if !out.is_empty() {
            return;
        }
        match tokio::time::timeout(Duration::from_secs(20), q.wait()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => fail(format!("wait: {e}")),
            Err(_) => fail(format!("no completion in 20 s ({:?})", q.failed())),
        }
    }
}

/// The listening side: accepts one good queue (rejecting the bad one first), then serves
/// commands until the peer disconnects.
async fn serve(mut listener: Listener) -> u64 {
    let mut served = 0;
    loop {
        let req = match listener.next_request().await {
            Ok(r) => r,
            Err(e) => fail(format!("listener: {e}")),
        };
        let params = match parse_request(&req.private_data, &LIMITS) {
            Ok(p) => p,
            Err(code) => {
                println!("server: rejecting a request with status {code}");
                if let Err(e) = req.reject(&reject_data(code)) {
                    fail(format!("reject: {e}"));
                }
                continue;
            }
        };
        let attr = req
            .device_attr()
            .unwrap_or_else(|e| fail(format!("device: {e}")));
        let ord = negotiate_ord(req.initiator_depth, attr.max_qp_init_rd_atom)
            .unwrap_or_else(|c| fail(format!("ord: {c}")));
        let cfg = QueueConfig::target(params.depth, 0, ord);
        let mut q: CapsuleQueue<Buf> =
            CapsuleQueue::accept(req, cfg, &accept_data(params.depth), &reject_data(6))
                .unwrap_or_else(|e| fail(format!("accept: {e}")));
        let mut staging = Some(
            q.register(vec![0u8; LEN].into_boxed_slice())
                .unwrap_or_else(|e| fail(format!("register: {e}"))),
        );
        let mut evs = Vec::new();
        let mut pending = None;
        loop {
            if let Err(e) = q.poll(&mut evs) {
                fail(format!("poll: {e}"));
            }
            if evs.is_empty() {
                tokio::select! {
                    ev = q.cm_event() => match ev {
                        Ok(nvmf_rdma::CmEvent::Disconnected) => return served,
                        Ok(nvmf_rdma::CmEvent::Established) => {}
                        other => fail(format!("server CM event {other:?}")),
                    },
                    r = q.wait() => {
                        if let Err(e) = r {
                            fail(format!("wait: {e}"));
                        }
                    }
                }
                continue;
            }
            for ev in evs.drain(..) {
                match ev {
                    Event::Received(slot) => {
                        let m = q.message(&slot).to_vec();
                        if m.len() != 64 {
                            fail(format!("command of {} bytes", m.len()));
                        }
                        let token = u64::from_le_bytes(m[8..16].try_into().unwrap());
                        let remote = RemoteKey {
                            addr: u64::from_le_bytes(m[16..24].try_into().unwrap()),
                            len: u32::from_le_bytes(m[24..28].try_into().unwrap()),
                            rkey: u32::from_le_bytes(m[28..32].try_into().unwrap()),
                        };
                        let buf = staging
                            .take()
                            .unwrap_or_else(|| fail("staging busy".into()));
                        match m[0] {
                            1 => {
                                if let Err((e, _)) = q.read(buf, remote.len as usize, remote, token)
                                {
                                    fail(format!("read: {e}"));
                                }
                                pending = Some(slot);
                            }
                            2 => {
                                // Send back what was fetched, each byte incremented.
                                let mut buf = buf;
                                for b in buf.bytes_mut()[..remote.len as usize].iter_mut() {
                                    *b = b.wrapping_add(1);
                                }
                                let data = DataOut {
                                    buf,
                                    len: remote.len as usize,
                                    remote,
                                };
                                q.respond(slot, &token.to_le_bytes(), Some(data), None, token)
                                    .unwrap_or_else(|e| fail(format!("respond: {e}")));
                                served += 1;
                            }
                            op => fail(format!("unknown op {op}")),
                        }
                    }
                    Event::ReadDone { token, buf, ok } => {
                        if !ok {
                            fail(format!("RDMA READ failed: {:?}", q.failed()));
                        }
                        staging = Some(buf);
                        let slot = pending.take().unwrap_or_else(|| fail("no pending".into()));
                        q.respond(slot, &token.to_le_bytes(), None, None, token)
                            .unwrap_or_else(|e| fail(format!("respond: {e}")));
                        served += 1;
                    }
                    Event::Sent { data, ok, .. } => {
                        if !ok {
                            fail(format!("send failed: {:?}", q.failed()));
                        }
                        if let Some(d) = data {
                            staging = Some(d);
                        }
                    }
                }
            }
        }
    }
}

fn host_cfg() -> QueueConfig {
    QueueConfig {
        recv_slots: 8,
        recv_size: 16,
        send_slots: 8,
        send_size: 64,
        send_depth: 16,
        initiator_depth: 0,
        responder_resources: 16,
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // Queues stay on the thread that created them.
    tokio::task::LocalSet::new().run_until(run()).await;
}

async fn run() {
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| fail("usage: loopback ADDR:PORT".into()));
    let devs = devices().unwrap_or_else(|e| fail(format!("devices: {e}")));
    for d in &devs {
        println!("device {} {:?}", d.name, d.attr);
    }
    let listener = Listener::bind(addr, 16).unwrap_or_else(|e| fail(format!("bind: {e}")));
    println!("listening on {}", listener.local_addr());
    let server = tokio::task::spawn_local(serve(listener));

    // A request for a queue the target does not have is rejected with INVALID_QID.
    match CapsuleQueue::<Buf>::connect(
        addr,
        host_cfg(),
        &request_data(9, 7, 8, 1),
        Duration::from_secs(10),
        None,
    )
    .await
    {
        Err(Error::Rejected { private_data, .. }) => {
            let code = parse_reject(&private_data);
            println!("client: rejected with {code:?}");
            if code != Some(nvme_spec::rdma::reject::INVALID_QID) {
                fail(format!("wrong reject record {private_data:?}"));
            }
        }
        Err(e) => fail(format!("expected a reject, got {e}")),
        Ok(_) => fail("a bad request was accepted".into()),
    }

    let (mut q, accept) = CapsuleQueue::<Buf>::connect(
        addr,
        host_cfg(),
        &request_data(1, 7, 8, 1),
        Duration::from_secs(10),
        None,
    )
    .await
    .unwrap_or_else(|e| fail(format!("connect: {e}")));
    println!("client: connected, crqsize {:?}", parse_accept(&accept));
    if parse_accept(&accept) != Some(8) {
        fail("wrong accept record".into());
    }
    let mut mem = Some(
        q.pd()
            .register(
                vec![0u8; LEN].into_boxed_slice(),
                Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap_or_else(|e| fail(format!("register: {e}"))),
    );
    let mut evs = Vec::new();
    for round in 0..ROUNDS {
        let len = (4096 * (1 + round as usize % 64)).min(LEN);
        let mut m = mem.take().unwrap();
        for (i, b) in m.bytes_mut()[..len].iter_mut().enumerate() {
            *b = (i as u64 ^ round) as u8;
        }
        let remote = m.remote_key(0, len).unwrap();
        mem = Some(m);
        for op in [1u8, 2] {
            q.send(
                &command(op, round * 2 + u64::from(op), remote),
                None,
                None,
                0,
            )
            .unwrap_or_else(|e| fail(format!("send: {e}")));
            let mut got = false;
            while !got {
                next_events(&mut q, &mut evs).await;
                for ev in std::mem::take(&mut evs) {
                    match ev {
                        Event::Received(slot) => {
                            let t = u64::from_le_bytes(q.message(&slot)[..8].try_into().unwrap());
                            if t != round * 2 + u64::from(op) {
                                fail(format!("reply for {t}"));
                            }
                            q.repost(slot)
                                .unwrap_or_else(|e| fail(format!("repost: {e}")));
                            got = true;
                        }
                        Event::Sent { ok, .. } if !ok => {
                            fail(format!("client send failed: {:?}", q.failed()))
                        }
                        _ => {}
                    }
                }
            }
        }
        let m = mem.as_mut().unwrap();
        for (i, b) in m.bytes_mut()[..len].iter().enumerate() {
            if *b != ((i as u64 ^ round) as u8).wrapping_add(1) {
                fail(format!("round {round}: byte {i} is {b}"));
            }
        }
    }
    drop(mem);
    q.disconnect();
    let served = tokio::time::timeout(Duration::from_secs(20), server)
        .await
        .unwrap_or_else(|_| fail("server did not see the disconnect".into()))
        .unwrap_or_else(|e| fail(format!("server: {e}")));
    if served != ROUNDS * 2 {
        fail(format!("server answered {served} commands"));
    }
    println!("LOOPBACK PASS: {ROUNDS} rounds of RDMA READ + RDMA WRITE up to {LEN} bytes");
}
