//! Writes patterns to a namespace over any transport and reads them back: concurrent writes
//! spread over every I/O queue, one transfer larger than the controller's per-command limit
//! (split into several commands), small writes that fit in the command capsule, then reads
//! of everything and a byte-for-byte comparison, and a check of the queue counters.
//! **It overwrites the first few MiB of the namespace.**
//!
//! With `reconnect` as the fifth argument it then prints `VERIFY WAITING-FOR-RECONNECT` and
//! keeps reading everything back until the controller has reconnected (the caller breaks the
//! connection meanwhile), then writes and reads once more on the new connection. With `stall FILE`
//! (I/O timeout 10 s) it prints `VERIFY WAITING-FOR-STALL`, waits for FILE to exist (the caller
//! creates it once the target is stopped), expects a read to time out, then waits for the
//! reconnect (the caller lets the target go on) and reads everything back.
//!
//! Then (without a fifth argument) a transfer just above the per-command limit goes through a
//! buffer from `Controller::register_buffer`: written from it, read back into it (and one block
//! into its middle), compared, and the queue counters checked: over NVMe/RDMA every command of
//! that phase named the registered buffer (`registered_commands`), so none went through a slot
//! buffer; the line `VERIFY REGISTERED` reports it. Over NVMe/RDMA a read into it whose future
//! is dropped in flight must leave it busy until its commands end (`VERIFY REGISTERED-CANCELLED`).
//! Then GPU request rings (`Controller::attach_gpu_rings`) driven by the CPU stand-in of the
//! device side: one ring of 8 slots per I/O queue, threads acting as warps that read random
//! pieces of the concurrent chunks through them (single and warp-collective submits, many laps
//! of each ring) and compare every byte, and requests outside the bound range answered with
//! LBA Out of Range without reaching the wire. Over NVMe/RDMA every ring read must have named
//! the ring's registered data area in its keyed SGL (`registered_commands`); the line
//! `VERIFY RINGS` reports it.
//! Then (without a fifth argument) a run-to-completion queue pair writes a region in pieces
//! of 16 blocks and reads it back in pieces of 1 to 16 blocks, compared; over NVMe/RDMA its
//! command buffers are registered during the writes and never again during the reads
//! (`buffer_registrations`); the line `VERIFY QUEUE-PAIR` reports it.
//! With `reconnect`, a buffer registered before the break is read into after the reconnect;
//! with `stall`, a registered read that times out must leave its buffer free at once. With
//! either, a queue pair opened before the break reads the pieces back after the reconnect, on
//! its own new connection (`VERIFY QUEUE-PAIR-ACROSS-RECONNECT`).
//!
//! ```text
//! cargo run -p nvmeof-initiator --example verify -- ADDR NQN [NSID] [QUEUES] [reconnect|stall FILE]
//! cargo run -p nvmeof-initiator --example verify -- rdma://10.0.2.15:4420 NQN 1 3
//! ```
//!
//! `ADDR` is `HOST:PORT` (NVMe/TCP) or `rdma://HOST:PORT` (NVMe/RDMA). Prints
//! `VERIFY PASS` and exits with 0 when everything read back as written.

use std::future::Future;
use std::time::{Duration, Instant};

use nvmeof_initiator::{
    ConnectOptions, Controller, HostIdentity, Namespace, QueuePair, QueuePolicy, TargetAddr,
};
use tokio::task::JoinSet;

/// Bytes of each concurrent write.
const CHUNK: usize = 64 * 1024;
/// Concurrent writes per I/O queue.
const PER_QUEUE: usize = 4;
/// Blocks of each write through the queue pair.
const QP_PIECE: u64 = 16;
/// Blocks the queue pair writes and reads back.
const QP_AREA: u64 = 256;
/// Queue pair commands in flight at most.
const QP_IN_FLIGHT: usize = 16;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn fail(msg: String) -> ! {
    eprintln!("VERIFY FAIL: {msg}");
    std::process::exit(1);
}

/// Writes (or reads back and compares) `(lba, seed, len)` pieces concurrently.
async fn pieces(ns: &Namespace, list: &[(u64, u64, usize)], write: bool) -> Result<(), String> {
    let mut set = JoinSet::new();
    for &(lba, seed, len) in list {
        let ns = ns.clone();
        set.spawn(async move {
            let want = pattern(seed, len);
            if write {
                return ns
                    .write(lba, &want)
                    .await
                    .map_err(|e| format!("write at {lba}: {e}"));
            }
            let mut got = vec![0u8; len];
            ns.read(lba, &mut got)
                .await
                .map_err(|e| format!("read at {lba}: {e}"))?;
            match got.iter().zip(&want).position(|(a, b)| a != b) {
                None => Ok(()),
                Some(i) => Err(format!(
                    "{len} bytes at block {lba} differ from what was written (first at byte {i})"
                )),
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.map_err(|e| format!("task: {e}"))??;
    }
    Ok(())
}

/// Writes (or reads back and compares) `(lba, seed, len)` pieces through a run-to-completion
/// queue pair, at most [`QP_IN_FLIGHT`] at a time, each wait bounded.
async fn qp_pieces(
    qp: &mut QueuePair,
    list: &[(u64, u64, usize)],
    write: bool,
) -> Result<(), String> {
    let mut done = Vec::new();
    let (mut next, mut finished) = (0, 0);
    while finished < list.len() {
        while next < list.len() && qp.in_flight() < QP_IN_FLIGHT {
            let (lba, seed, len) = list[next];
            let r = if write {
                qp.write(lba, pattern(seed, len), next as u64)
            } else {
                qp.read(lba, vec![0; len], next as u64)
            };
            r.map_err(|r| format!("queue pair submit at {lba}: {}", r.error))?;
            next += 1;
        }
        if qp.wait(&mut done, 1, Some(Duration::from_secs(150))).await == 0 {
            return Err(format!(
                "queue pair: no completion within 150 s ({:?})",
                qp.stats()
            ));
        }
        for c in done.drain(..) {
            let (lba, seed, len) = list[c.user_data as usize];
            c.result
                .map_err(|e| format!("queue pair command at {lba}: {e}"))?;
            if !write && c.buf != pattern(seed, len) {
                return Err(format!(
                    "{len} bytes read through the queue pair at block {lba} differ from what was written"
                ));
            }
            finished += 1;
        }
    }
    Ok(())
}

/// A run-to-completion queue pair over `area` (blocks from its first): one round of writes of
/// [`QP_PIECE`] blocks (every command identifier the phase uses gets its buffer), then reads of
/// 1 to `QP_PIECE` blocks of everything back, compared. Over NVMe/RDMA the first round
/// registers each identifier's buffer once; the reads register nothing more
/// (`buffer_registrations` stays put). Prints `VERIFY QUEUE-PAIR`.
async fn queue_pair(
    ns: &Namespace,
    area: (u64, u64),
    transport: nvmeof_initiator::Transport,
) -> Result<(), String> {
    let bs = ns.block_size() as usize;
    let mut qp = QueuePair::open(ns)
        .await
        .map_err(|e| format!("open: {e}"))?;
    let writes: Vec<_> = (0..area.1 / QP_PIECE)
        .map(|i| (area.0 + i * QP_PIECE, 3000 + i, QP_PIECE as usize * bs))
        .collect();
    qp_pieces(&mut qp, &writes, true).await?;
    let warm = qp.stats();
    let whole: Vec<u8> = writes
        .iter()
        .flat_map(|&(_, seed, len)| pattern(seed, len))
        .collect();
    // Read back in pieces of 1 to QP_PIECE blocks, each compared with its part of the write.
    let mut done = Vec::new();
    let (mut lba, mut k, mut reads) = (area.0, 0u64, 0u64);
    let end = area.0 + (area.1 / QP_PIECE) * QP_PIECE;
    while lba < end || qp.in_flight() > 0 {
        while lba < end && qp.in_flight() < QP_IN_FLIGHT {
            let blocks = (1 + k % QP_PIECE).min(end - lba);
            qp.read(lba, vec![0; blocks as usize * bs], lba)
                .map_err(|r| format!("queue pair submit at {lba}: {}", r.error))?;
            lba += blocks;
            k += 1;
            reads += 1;
        }
        if qp.wait(&mut done, 1, Some(Duration::from_secs(150))).await == 0 {
            return Err("queue pair: no completion within 150 s".into());
        }
        for c in done.drain(..) {
            let at = c.user_data;
            c.result
                .map_err(|e| format!("queue pair read at {at}: {e}"))?;
            let off = (at - area.0) as usize * bs;
            if whole.get(off..off + c.buf.len()) != Some(&c.buf[..]) {
                return Err(format!(
                    "{} bytes read through the queue pair at block {at} differ from what was written",
                    c.buf.len()
                ));
            }
        }
    }
    let st = qp.stats();
    let registered = st.buffer_registrations;
    if transport == nvmeof_initiator::Transport::Rdma
        && (warm.buffer_registrations == 0 || registered != warm.buffer_registrations)
    {
        return Err(format!(
            "queue pair buffers registered {} times for the writes, {registered} after {reads} reads: expected some, then none more",
            warm.buffer_registrations
        ));
    }
    println!(
        "VERIFY QUEUE-PAIR transport={transport} qid={} commands={} reads={reads} buffer_registrations={registered}",
        qp.qid(),
        st.commands
    );
    Ok(())
}

/// Reads `list` back through a queue pair opened before the connection broke: it reconnected
/// with the controller. Prints `VERIFY QUEUE-PAIR-ACROSS-RECONNECT`.
async fn queue_pair_across(qp: Option<&mut QueuePair>, list: &[(u64, u64, usize)]) {
    let Some(qp) = qp else { return };
    qp_pieces(qp, list, false)
        .await
        .unwrap_or_else(|e| fail(format!("queue pair after the reconnect: {e}")));
    let st = qp.stats();
    println!(
        "VERIFY QUEUE-PAIR-ACROSS-RECONNECT connections={} retries={} connected={}",
        st.connections,
        st.retries,
        qp.is_connected()
    );
    if st.connections < 2 {
        fail("the queue pair did not reconnect".into());
    }
}

/// Starts a read into `buf`, drops it after its first poll, and checks that the buffer is busy
/// until its commands end and then holds `want`.
async fn dropped_read(
    ns: &Namespace,
    lba: u64,
    buf: &mut nvmeof_initiator::RegisteredBuffer,
    want: &[u8],
) -> Result<(), String> {
    let len = want.len();
    buf.as_mut_slice().map_err(|e| e.to_string())?.fill(0);
    let ready = {
        let mut fut = std::pin::pin!(ns.read_registered(lba, buf, 0, len));
        std::future::poll_fn(|cx| std::task::Poll::Ready(fut.as_mut().poll(cx).is_ready())).await
    };
    let t = Instant::now();
    let mut busy = false;
    loop {
        match buf.as_slice() {
            Ok(_) => break,
            Err(nvmeof_initiator::Error::BufferBusy) if t.elapsed() < Duration::from_secs(30) => {
                busy = true;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => return Err(format!("after a dropped read: {e}")),
        }
    }
    if buf.as_slice().map_err(|e| e.to_string())? != want {
        return Err("the bytes of a dropped read differ once it ended".into());
    }
    println!(
        "VERIFY REGISTERED-CANCELLED completed_at_first_poll={ready} busy_after_drop={busy} released_after_ms={}",
        t.elapsed().as_millis()
    );
    Ok(())
}

/// Writes `len` bytes from a registered buffer at block `lba`, reads them back into it, and
/// checks the bytes (also through an ordinary read) and the queue counters: over NVMe/RDMA
/// every command of the phase must have named the registered buffer (no slot buffer, no
/// copy), over NVMe/TCP none can.
async fn registered(
    ctrl: &Controller,
    ns: &Namespace,
    lba: u64,
    len: usize,
    transport: nvmeof_initiator::Transport,
) -> Result<(), String> {
    let rdma = transport == nvmeof_initiator::Transport::Rdma;
    let counts = || {
        let st = ctrl.queue_stats();
        let io = st.iter().filter(|s| s.qid != 0);
        io.fold((0, 0, 0, Vec::new()), |(c, r, b, mut per), s| {
            per.push(s.registered_commands);
            (
                c + s.commands,
                r + s.registered_commands,
                b + s.registered_bytes,
                per,
            )
        })
    };
    let mut buf = ctrl
        .register_buffer(len)
        .map_err(|e| format!("register {len} bytes: {e}"))?;
    if buf.is_registered() != rdma {
        return Err(format!(
            "registered={} over {transport}",
            buf.is_registered()
        ));
    }
    let want = pattern(3000, len);
    buf.as_mut_slice()
        .map_err(|e| e.to_string())?
        .copy_from_slice(&want);
    let before = counts();
    ns.write_registered(lba, &mut buf, 0, len)
        .await
        .map_err(|e| format!("write_registered: {e}"))?;
    buf.as_mut_slice().map_err(|e| e.to_string())?.fill(0);
    ns.read_registered(lba, &mut buf, 0, len)
        .await
        .map_err(|e| format!("read_registered: {e}"))?;
    // A sub-range: one block into the middle of the buffer.
    let bs = ns.block_size() as usize;
    let mid = len / 2 / bs * bs;
    buf.as_mut_slice().map_err(|e| e.to_string())?[mid..mid + bs].fill(0);
    ns.read_registered(lba + (mid / bs) as u64, &mut buf, mid, bs)
        .await
        .map_err(|e| format!("read_registered at offset {mid}: {e}"))?;
    let after = counts();
    let got = buf.as_slice().map_err(|e| e.to_string())?;
    if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
        return Err(format!(
            "{len} bytes read into registered memory differ from those written from it (first at byte {i})"
        ));
    }
    // Over NVMe/RDMA, a read whose future is dropped once its commands are out: the buffer
    // stays busy (its bytes unreachable) until they end, then holds the data. (Over NVMe/TCP a
    // dropped read copies nothing.)
    if rdma {
        dropped_read(ns, lba, &mut buf, &want).await?;
    }
    let mut plain = vec![0u8; len];
    ns.read(lba, &mut plain)
        .await
        .map_err(|e| format!("read: {e}"))?;
    if plain != want {
        return Err("an ordinary read differs from what registered memory wrote".into());
    }
    let commands = after.0 - before.0;
    let reg_commands = after.1 - before.1;
    let reg_bytes = after.2 - before.2;
    // Queues that carried registered commands: the buffer was registered once, in the
    // protection domain every queue shares.
    let queues_used = after.3.iter().zip(&before.3).filter(|(a, b)| a > b).count();
    if rdma && after.3.len() > 1 && queues_used < 2 {
        return Err(format!(
            "registered commands went through {queues_used} queue(s), expected several"
        ));
    }
    let max = ctrl.info().max_transfer_bytes as u64;
    let expected = 2 * (len as u64).div_ceil(max) + 1;
    if rdma && (reg_commands != commands || reg_commands != expected) {
        return Err(format!(
            "{commands} commands, {reg_commands} through registered memory, {expected} expected"
        ));
    }
    if rdma && reg_bytes != 2 * len as u64 + bs as u64 {
        return Err(format!("{reg_bytes} bytes through registered memory"));
    }
    if !rdma && reg_commands != 0 {
        return Err(format!(
            "{reg_commands} registered commands over {transport}"
        ));
    }
    println!(
        "VERIFY REGISTERED transport={transport} registered={} commands={commands} registered_commands={reg_commands} registered_bytes={reg_bytes} slot_commands={} queues={queues_used}",
        if rdma { "yes" } else { "no" },
        commands - reg_commands
    );
    Ok(())
}

/// Stand-in warps per ring.
const RING_WARPS: usize = 2;
/// Reads per stand-in warp.
const RING_READS: usize = 600;
/// Slots per ring (few, so that the reads wrap each ring many times).
const RING_SLOTS: u32 = 8;

/// GPU request rings served by the controller's queues, driven by the CPU stand-in: random
/// reads of the concurrent chunks (`list`, written with their patterns) compared byte for
/// byte, warp-collective submits, and requests out of the bound range refused with a status.
async fn rings(
    ctrl: &Controller,
    ns: &Namespace,
    list: &[(u64, u64, usize)],
    transport: nvmeof_initiator::Transport,
) -> Result<(), String> {
    use nvmeof_initiator::gpu_ring::proto::status;
    use nvmeof_initiator::gpu_ring::standin::WarpRequest;
    use nvmeof_initiator::gpu_ring::{DataMode, NsBinding, RingConfig, RingSet};

    let bs = ns.block_size() as usize;
    let chunk_blocks = (CHUNK / bs) as u64;
    let bound = list.len() as u64 * chunk_blocks;
    let slot_bytes = (16 * 1024).max(bs as u32);
    let cfg = RingConfig {
        slots: RING_SLOTS,
        slot_bytes,
        mode: DataMode::Pull,
    };
    let binding = NsBinding {
        nsid: ns.nsid(),
        block_size: bs as u32,
        blocks: bound,
    };
    let nrings = u32::from(ctrl.info().io_queues);
    let mut set = RingSet::new_host(nrings, cfg, &[binding]).map_err(|e| e.to_string())?;
    let dev = set.standin_rings();
    let counted = |ctrl: &Controller| {
        let s = ctrl.queue_stats();
        (
            s.iter().map(|q| q.ring_reads).sum::<u64>(),
            s.iter().map(|q| q.ring_rejected).sum::<u64>(),
            s.iter().map(|q| q.registered_commands).sum::<u64>(),
        )
    };
    let (reads0, rejected0, reg0) = counted(ctrl);
    let attached = ctrl
        .attach_gpu_rings(&mut set)
        .await
        .map_err(|e| format!("attach_gpu_rings: {e}"))?;
    // What each chunk holds.
    let chunks: Vec<Vec<u8>> = list.iter().map(|p| pattern(p.1, CHUNK)).collect();
    let nchunks = chunks.len() as u64;
    let max_blocks = slot_bytes as u64 / bs as u64;
    let wait = Duration::from_secs(60);
    let res = tokio::task::spawn_blocking({
        let dev = dev.clone();
        move || {
            std::thread::scope(|s| {
                let warps: Vec<_> = (0..dev.len() * RING_WARPS)
                    .map(|w| {
                        let ring = &dev[w % dev.len()];
                        let chunks = &chunks;
                        s.spawn(move || -> Result<u64, String> {
                            let mut x = 0x2545_F491_4F6C_DD1D ^ (w as u64 + 1);
                            let mut next = || {
                                x ^= x << 13;
                                x ^= x >> 7;
                                x ^= x << 17;
                                x
                            };
                            let mut buf = vec![0u8; slot_bytes as usize];
                            let mut done = 0;
                            while done < RING_READS {
                                // Every third round a warp-collective submit of four reads.
                                let k = if done % 3 == 2 { 4 } else { 1 };
                                let reqs: Vec<WarpRequest> = (0..k)
                                    .map(|_| {
                                        let chunk = next() % nchunks;
                                        let n = 1 + next() % max_blocks.min(chunk_blocks);
                                        let lba = chunk * chunk_blocks
                                            + next() % (chunk_blocks - n + 1);
                                        WarpRequest {
                                            ns: 0,
                                            lba,
                                            nblocks: n as u32,
                                            dst: 0,
                                        }
                                    })
                                    .collect();
                                let tickets = if k == 1 {
                                    vec![ring.submit(0, reqs[0].lba, reqs[0].nblocks, 0)]
                                } else {
                                    ring.submit_warp(&reqs)
                                };
                                for (r, t) in reqs.iter().zip(tickets) {
                                    let len = r.nblocks as usize * bs;
                                    let st = ring.wait(t, wait, &mut buf[..len]);
                                    if st != status::SUCCESS {
                                        return Err(format!(
                                            "warp {w}: read of {} blocks at {} got status {st:#x}",
                                            r.nblocks, r.lba
                                        ));
                                    }
                                    let chunk = &chunks[(r.lba / chunk_blocks) as usize];
                                    let off = (r.lba % chunk_blocks) as usize * bs;
                                    if buf[..len] != chunk[off..off + len] {
                                        return Err(format!(
                                            "warp {w}: {len} bytes at block {} differ from what was written",
                                            r.lba
                                        ));
                                    }
                                    done += 1;
                                }
                            }
                            // Outside the bound range: refused, never sent.
                            let st = ring.read(0, bound, 1, &mut buf[..bs], wait);
                            if st != status::LBA_OUT_OF_RANGE {
                                return Err(format!(
                                    "warp {w}: a read past the bound range got {st:#x}"
                                ));
                            }
                            Ok(done as u64)
                        })
                    })
                    .collect();
                warps
                    .into_iter()
                    .map(|h| h.join().map_err(|_| "a warp panicked".to_string())?)
                    .sum::<Result<u64, String>>()
            })
        }
    })
    .await
    .map_err(|e| e.to_string())?;
    attached.detach().await;
    let done = res?;
    let (reads1, rejected1, reg1) = counted(ctrl);
    let (reads, rejected, reg) = (reads1 - reads0, rejected1 - rejected0, reg1 - reg0);
    let refused = (dev.len() * RING_WARPS) as u64;
    if reads != done || rejected != refused {
        return Err(format!(
            "the queues counted {reads} ring reads and {rejected} refused, expected {done} and {refused}"
        ));
    }
    let rdma = transport == nvmeof_initiator::Transport::Rdma;
    // Over NVMe/RDMA each ring read names its slot in the registered data area.
    if rdma && reg != reads {
        return Err(format!(
            "{reg} of {reads} ring reads named the rings' registered memory"
        ));
    }
    println!(
        "VERIFY RINGS transport={transport} rings={nrings} slots={RING_SLOTS} reads={reads} refused={rejected} registered_commands={reg}"
    );
    Ok(())
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(addr), Some(nqn)) = (args.next(), args.next()) else {
        eprintln!("usage: verify ADDR NQN [NSID] [QUEUES] [reconnect|stall FILE]");
        std::process::exit(2);
    };
    let nsid: u32 = args.next().map_or(1, |s| s.parse().unwrap_or(1));
    let queues: u16 = args.next().map_or(2, |s| s.parse().unwrap_or(2));
    let phase = args.next().unwrap_or_default();
    let reconnect = phase == "reconnect";
    let stall = phase == "stall";
    let stall_file = args.next().unwrap_or_default();
    let addr: TargetAddr = addr.parse().unwrap_or_else(|e| fail(format!("{e}")));
    let host = HostIdentity::new(
        "nqn.2014-08.org.nvmexpress:uuid:6c1d2a52-4b1e-4c57-9b0e-5f3b2b0a6e01",
        *b"nvmeof-verify-01",
    )
    .unwrap_or_else(|e| fail(format!("{e}")));
    let mut opts = ConnectOptions::new(addr.clone(), nqn, host);
    opts.io_queues = Some(queues);
    opts.queue_depth = 32;
    opts.queue_policy = QueuePolicy::RoundRobin;
    opts.queue_pairs = 1;
    opts.timeouts.io = Duration::from_secs(if stall { 10 } else { 120 });
    opts.timeouts.admin = Duration::from_secs(30);

    let ctrl = Controller::connect(opts)
        .await
        .unwrap_or_else(|e| fail(format!("connect to {addr}: {e}")));
    let info = ctrl.info();
    println!(
        "connected to {} at {} (controller {}, {} I/O queues of {} entries, MDTS {:?} bytes, {} bytes per command, {} bytes in capsule)",
        info.subnqn,
        info.addr,
        info.cntlid,
        info.io_queues,
        info.queue_depth,
        info.mdts_bytes,
        info.max_transfer_bytes,
        info.in_capsule_data_bytes
    );
    if info.io_queues != queues {
        fail(format!(
            "asked for {queues} I/O queues, got {}",
            info.io_queues
        ));
    }
    let ns = ctrl
        .namespace(nsid)
        .await
        .unwrap_or_else(|e| fail(format!("namespace {nsid}: {e}")));
    let bs = ns.block_size() as usize;
    let blocks = |bytes: usize| bytes.div_ceil(bs) as u64;

    // Concurrent chunks, then one transfer above the per-command limit, then small writes
    // that fit in the capsule, laid out one after the other.
    let mut list = Vec::new();
    let mut lba = 0u64;
    for i in 0..usize::from(queues) * PER_QUEUE {
        list.push((lba, i as u64 + 1, CHUNK));
        lba += blocks(CHUNK);
    }
    let big = info.max_transfer_bytes as usize * 2 + 3 * bs;
    let big_piece = (lba, 1000, big);
    lba += blocks(big);
    let small = (info.in_capsule_data_bytes as usize / bs * bs).min(4096);
    let mut smalls = Vec::new();
    if small > 0 {
        for i in 0..4 {
            smalls.push((lba, 2000 + i, small));
            lba += blocks(small);
        }
    }
    // Registered memory: one transfer just above the per-command limit (two keyed commands).
    let reg_len = info.max_transfer_bytes as usize + 2 * bs;
    let reg_lba = lba;
    lba += blocks(reg_len);
    let qp_area = (lba, QP_AREA);
    lba += QP_AREA;
    let total: usize = list.iter().chain(&smalls).map(|p| p.2).sum::<usize>() + big;
    if lba * bs as u64 > ns.size_bytes() {
        fail(format!(
            "the namespace is smaller than the {total} bytes this needs"
        ));
    }

    let t = Instant::now();
    pieces(&ns, &list, true).await.unwrap_or_else(|e| fail(e));
    pieces(&ns, &[big_piece], true)
        .await
        .unwrap_or_else(|e| fail(e));
    pieces(&ns, &smalls, true).await.unwrap_or_else(|e| fail(e));
    ns.flush()
        .await
        .unwrap_or_else(|e| fail(format!("flush: {e}")));
    let wrote = t.elapsed();
    let t = Instant::now();
    pieces(&ns, &list, false).await.unwrap_or_else(|e| fail(e));
    pieces(&ns, &[big_piece], false)
        .await
        .unwrap_or_else(|e| fail(e));
    pieces(&ns, &smalls, false)
        .await
        .unwrap_or_else(|e| fail(e));
    let read = t.elapsed();
    println!(
        "wrote and read back {total} bytes ({} concurrent {CHUNK}-byte pieces, one of {big} bytes, {} of {small} bytes): write {:.0} ms, read {:.0} ms",
        list.len(),
        smalls.len(),
        wrote.as_secs_f64() * 1e3,
        read.as_secs_f64() * 1e3
    );

    let stats = ctrl.queue_stats();
    for s in &stats {
        println!(
            "queue {}: {} commands, {} in-capsule writes, {} keyed/R2T writes, {} bytes read, {} bytes written, {} retries, {} timeouts",
            s.qid,
            s.commands,
            s.in_capsule_writes,
            s.r2t_writes,
            s.bytes_read,
            s.bytes_written,
            s.retries,
            s.timeouts
        );
    }
    let io: Vec<_> = stats.iter().filter(|s| s.qid != 0).collect();
    if let Some(idle) = io.iter().find(|s| s.commands == 0) {
        fail(format!("I/O queue {} carried no command", idle.qid));
    }
    let sum = |f: fn(&nvmeof_initiator::QueueStats) -> u64| io.iter().map(|s| f(s)).sum::<u64>();
    if small > 0 && sum(|s| s.in_capsule_writes) == 0 {
        fail("no write travelled in the command capsule".into());
    }
    if sum(|s| s.r2t_writes) == 0 {
        fail("no write had its data fetched by the target".into());
    }
    if sum(|s| s.bytes_read) < total as u64 {
        fail(format!(
            "{} bytes read, expected {total}",
            sum(|s| s.bytes_read)
        ));
    }
    if sum(|s| s.timeouts) + sum(|s| s.retries) != 0 {
        fail("commands timed out or were retried".into());
    }
    if phase.is_empty() {
        registered(&ctrl, &ns, reg_lba, reg_len, addr.transport)
            .await
            .unwrap_or_else(|e| fail(format!("registered memory: {e}")));
    }
    if phase.is_empty() {
        queue_pair(&ns, qp_area, addr.transport)
            .await
            .unwrap_or_else(|e| fail(format!("queue pair: {e}")));
    }
    // Opened before the connection breaks, used after the reconnect.
    let mut early_qp = if phase.is_empty() {
        None
    } else {
        let qp = QueuePair::open(&ns)
            .await
            .unwrap_or_else(|e| fail(format!("queue pair: {e}")));
        Some(qp)
    };
    if phase.is_empty() {
        rings(&ctrl, &ns, &list, addr.transport)
            .await
            .unwrap_or_else(|e| fail(format!("GPU request rings: {e}")));
    }
    if reconnect {
        // Registered before the connection breaks, used after the reconnect: the controller
        // keeps its protection domain when it reconnects through the same device.
        let mut early = ctrl
            .register_buffer(CHUNK)
            .unwrap_or_else(|e| fail(format!("register_buffer: {e}")));
        println!("VERIFY WAITING-FOR-RECONNECT");
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut rounds = 0u32;
        while ctrl.reconnects() == 0 {
            if Instant::now() > deadline {
                fail("the controller did not reconnect within 120 s".into());
            }
            // Reads in flight when the connection breaks are sent again after the reconnect.
            pieces(&ns, &list, false)
                .await
                .unwrap_or_else(|e| fail(format!("while reconnecting: {e}")));
            rounds += 1;
        }
        pieces(&ns, &list, false).await.unwrap_or_else(|e| fail(e));
        pieces(&ns, &[big_piece], false)
            .await
            .unwrap_or_else(|e| fail(e));
        let again = [(list[0].0, 77, CHUNK)];
        pieces(&ns, &again, true).await.unwrap_or_else(|e| fail(e));
        pieces(&ns, &again, false).await.unwrap_or_else(|e| fail(e));
        ns.read_registered(list[0].0, &mut early, 0, CHUNK)
            .await
            .unwrap_or_else(|e| fail(format!("read_registered after the reconnect: {e}")));
        if early.as_slice().unwrap_or_else(|e| fail(e.to_string())) != pattern(77, CHUNK) {
            fail("a read into memory registered before the reconnect differs".into());
        }
        println!("VERIFY REGISTERED-ACROSS-RECONNECT");
        queue_pair_across(early_qp.as_mut(), &list[1..]).await;
        let resent: u64 = ctrl.queue_stats().iter().map(|s| s.retries).sum();
        println!(
            "VERIFY RECONNECTED reconnects={} read rounds while waiting={rounds} commands resent={resent} state={:?}",
            ctrl.reconnects(),
            ctrl.state()
        );
    }
    if stall {
        println!("VERIFY WAITING-FOR-STALL");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !std::path::Path::new(&stall_file).exists() {
            if Instant::now() > deadline {
                fail(format!("{stall_file} did not appear within 60 s"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The target stops answering: the read times out, the queue pair is torn down before
        // the buffer goes back, and the controller reconnects once the target is back.
        let t = Instant::now();
        let mut reg = ctrl
            .register_buffer(CHUNK)
            .unwrap_or_else(|e| fail(format!("register_buffer: {e}")));
        let ns2 = ns.on_queue(1);
        let (slot_read, reg_read) = tokio::join!(
            pieces(&ns, &list[..1], false),
            ns2.read_registered(list[0].0, &mut reg, 0, CHUNK)
        );
        match slot_read {
            Err(e) if e.contains("timed out") => {
                println!(
                    "read timed out after {:.1} s: {e}",
                    t.elapsed().as_secs_f64()
                )
            }
            Err(e) => fail(format!("expected a timeout, got: {e}")),
            Ok(()) => fail("a read completed while the target was stopped".into()),
        }
        match reg_read {
            Err(nvmeof_initiator::Error::Timeout { .. }) => {}
            Err(e) => fail(format!("expected a registered read to time out, got: {e}")),
            Ok(()) => fail("a registered read completed while the target was stopped".into()),
        }
        // The timed-out command's queue pair is gone before the read returned: nothing can
        // write the buffer any more, and no command holds it.
        if let Err(e) = reg.as_slice() {
            fail(format!("registered buffer after the timeout: {e}"));
        }
        println!("VERIFY REGISTERED-TIMEOUT-RELEASED");
        let deadline = Instant::now() + Duration::from_secs(180);
        while ctrl.reconnects() == 0 || ctrl.state() != nvmeof_initiator::ControllerState::Connected
        {
            if Instant::now() > deadline {
                fail(format!(
                    "no reconnect within 180 s of the stall: {:?}",
                    ctrl.state()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        pieces(&ns, &list, false).await.unwrap_or_else(|e| fail(e));
        pieces(&ns, &[big_piece], false)
            .await
            .unwrap_or_else(|e| fail(e));
        queue_pair_across(early_qp.as_mut(), &list).await;
        let timeouts: u64 = ctrl.queue_stats().iter().map(|s| s.timeouts).sum();
        println!(
            "VERIFY STALL-RECOVERED timeouts={timeouts} reconnects={}",
            ctrl.reconnects()
        );
    }
    drop(early_qp);
    ctrl.disconnect()
        .await
        .unwrap_or_else(|e| fail(format!("disconnect: {e}")));
    println!(
        "VERIFY PASS transport={} queues={queues} bytes={total}",
        addr.transport
    );
}
