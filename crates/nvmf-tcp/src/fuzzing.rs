//! Drivers shared by the fuzz targets (`fuzz/`) and the property tests: they push arbitrary
//! bytes into a connection, split at arbitrary points, and answer events the way a real
//! peer would (R2Ts for write commands, H2CData for R2Ts, commands on the host side) so that
//! deep protocol states are reached.
//!
//! Input layout: byte 0 holds options (bit 0 header digest, bit 1 data digest, bit 2 digests
//! allowed on the target, bit 3 start with a valid ICReq/ICResp), bytes 1..3 seed the split
//! points, bytes 3..5 size the host's commands, and the rest is the byte stream.
//!
//! The drivers panic only when an engine invariant breaks: an event or error that
//! contradicts the configuration, a missing or malformed TermReq after a fatal error, or a
//! fatal error that is not repeated by the next call. Any panic inside the engine is a bug.

use nvme_spec::tcp::{PduType, TERM_REQ_HLEN, TERM_REQ_MAX_PLEN, TermReqHeader};

use crate::{
    Digests, HostConfig, HostConn, HostEvent, PduHeader, ProtocolError, TargetConfig, TargetConn,
    TargetEvent,
};

/// What a driver run reached, so tests can check that generated input gets deep.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Coverage {
    /// Connections established.
    pub connected: usize,
    /// Command capsules delivered to the target.
    pub commands: usize,
    /// H2CData PDUs delivered to the target.
    pub h2c_data: usize,
    /// C2HData pieces delivered to the host.
    pub c2h_data: usize,
    /// CapsuleResps delivered to the host.
    pub capsule_resps: usize,
    /// R2Ts delivered to the host.
    pub r2ts: usize,
    /// Non-fatal data digest errors reported.
    pub digest_errors: usize,
    /// TermReqs received from the peer.
    pub term_reqs: usize,
    /// Fatal protocol errors detected.
    pub fatal_errors: usize,
}

impl core::ops::AddAssign for Coverage {
    fn add_assign(&mut self, o: Self) {
        self.connected += o.connected;
        self.commands += o.commands;
        self.h2c_data += o.h2c_data;
        self.c2h_data += o.c2h_data;
        self.capsule_resps += o.capsule_resps;
        self.r2ts += o.r2ts;
        self.digest_errors += o.digest_errors;
        self.term_reqs += o.term_reqs;
        self.fatal_errors += o.fatal_errors;
    }
}

/// MAXH2CDATA used by the drivers.
pub const FUZZ_MAXH2CDATA: u32 = 4096;
/// In-capsule data limit used by the target driver.
pub const FUZZ_MAX_ICD: u32 = 8192;

/// Options decoded from the first input byte.
#[derive(Debug, Clone, Copy)]
struct Options {
    digests: Digests,
    allow_digests: bool,
    handshake: bool,
}

fn options(b: u8) -> Options {
    Options {
        digests: Digests {
            header: b & 1 != 0,
            data: b & 2 != 0,
        },
        allow_digests: b & 4 != 0,
        handshake: b & 8 != 0,
    }
}

/// Splits the input into header bytes and stream; short inputs get zero defaults.
fn parse_input(input: &[u8]) -> ([u8; 5], &[u8]) {
    let mut head = [0u8; 5];
    let n = input.len().min(5);
    head[..n].copy_from_slice(&input[..n]);
    (head, &input[n..])
}

/// Deterministic chunk sizes from a 16-bit seed (xorshift).
struct Splitter(u32);

impl Splitter {
    fn next(&mut self, remaining: usize) -> usize {
        let mut x = self.0 | 1;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.0 = x;
        // Mostly small pieces, sometimes everything that is left.
        let n = if x % 8 == 0 {
            remaining
        } else {
            (x % 97) as usize + 1
        };
        n.clamp(1, remaining.max(1))
    }
}

/// Checks that an error is sticky and that the TermReq queued for it is well formed.
fn check_failure(
    err: &ProtocolError,
    new_tx: &[u8],
    expect_type: PduType,
    again: Result<(), ProtocolError>,
) {
    assert_eq!(again, Err(err.clone()), "a fatal error must be repeated");
    if err.term_req_queued {
        let hdr = TermReqHeader::from_prefix(new_tx).expect("TermReq queued");
        assert_eq!(hdr.common().pdu_type_raw(), expect_type as u8);
        assert_eq!(hdr.common().plen() as usize, new_tx.len());
        assert!((TERM_REQ_HLEN..=TERM_REQ_MAX_PLEN).contains(&new_tx.len()));
        assert_eq!(hdr.fes_raw(), err.fes.code());
        assert_eq!(hdr.fei(), err.fei);
    } else {
        assert!(
            new_tx.is_empty(),
            "no TermReq may answer a malformed TermReq"
        );
    }
}

/// Feeds `input` to a [`TargetConn`] as described in the module documentation.
pub fn drive_target(input: &[u8]) -> Coverage {
    let mut cov = Coverage::default();
    let (head, stream) = parse_input(input);
    let opt = options(head[0]);
    let config = TargetConfig {
        maxh2cdata: FUZZ_MAXH2CDATA,
        max_in_capsule_data: FUZZ_MAX_ICD,
        allow_digests: opt.allow_digests,
        max_c2h_data: 1024,
        recv_buffer_size: 512,
        queue_size: 64,
    };
    let Ok(mut t) = TargetConn::new(config) else {
        unreachable!("the driver configuration is valid")
    };
    if opt.handshake {
        t.feed(PduHeader::ic_req(0, opt.digests, 0).as_bytes());
    }
    let mut split = Splitter(u32::from(u16::from_le_bytes([head[1], head[2]])));
    let mut pos = 0;
    let mut use_feed = false;
    loop {
        if t.is_closed() {
            return cov;
        }
        if let Err((e, before)) = target_events(&mut t, &mut cov) {
            let new_tx = t.pending_send()[before..].to_vec();
            let again = t.next_event().map(|_| ());
            check_failure(&e, &new_tx, PduType::C2hTermReq, again);
            cov.fatal_errors += 1;
            return cov;
        }
        // Drain part of the send buffer, like a socket that takes what it can.
        let pending = t.pending_send().len();
        t.consume_sent(split.next(pending.max(1)).min(pending));
        if pos >= stream.len() {
            return cov;
        }
        let n = split.next(stream.len() - pos);
        let piece = &stream[pos..pos + n];
        pos += n;
        use_feed = !use_feed;
        if use_feed {
            t.feed(piece);
        } else {
            let buf = t.recv_buf(n);
            assert!(buf.len() >= n, "recv_buf must offer the requested room");
            buf[..n].copy_from_slice(piece);
            t.commit_recv(n);
        }
    }
}

/// Handles events until more bytes are needed; on a fatal error returns it with the length
/// of the send buffer just before the failing call.
fn target_events(t: &mut TargetConn, cov: &mut Coverage) -> Result<(), (ProtocolError, usize)> {
    loop {
        let before = t.pending_send().len();
        let Some(ev) = t.next_event().map_err(|e| (e, before))? else {
            return Ok(());
        };
        let mut reply: Option<(u16, u32, bool)> = None;
        match ev {
            TargetEvent::Connected(p) => {
                assert!(p.hpda <= 31);
                cov.connected += 1;
            }
            TargetEvent::Command { sqe, data } => {
                cov.commands += 1;
                assert!(data.len() <= FUZZ_MAX_ICD as usize);
                let cid = u16::from_le_bytes([sqe[2], sqe[3]]);
                let len = u32::from_le_bytes([sqe[32], sqe[33], sqe[34], sqe[35]]);
                reply = Some((cid, len, data.is_empty()));
            }
            TargetEvent::CommandDataDigestError { .. } => cov.digest_errors += 1,
            TargetEvent::H2CData { data, datao, .. } => {
                cov.h2c_data += 1;
                assert!(!data.is_empty() && data.len() <= FUZZ_MAXH2CDATA as usize);
                assert!(datao.checked_add(data.len() as u32).is_some());
            }
            TargetEvent::H2CDataDigestError { datal, .. } => {
                assert!(datal > 0 && datal <= FUZZ_MAXH2CDATA);
                cov.digest_errors += 1;
            }
            TargetEvent::TermReq { data, .. } => {
                assert!(data.len() <= 128);
                cov.term_reqs += 1;
            }
        }
        if let Some((cid, len, no_icd)) = reply {
            // Exercise the send paths: ask for write data, or return read data.
            let len = len % 65_536;
            if len > 0 && no_icd && cid % 2 == 0 {
                let _ = t.send_r2t(cid, cid, 0, len);
            } else if len > 0 && cid % 3 == 0 {
                let data = vec![0xA5; len as usize];
                assert!(t.send_c2h_data(cid, 0, &data, true, cid % 5 == 0).is_ok());
            } else {
                let mut cqe = [0u8; 16];
                cqe[12..14].copy_from_slice(&cid.to_le_bytes());
                assert!(t.send_capsule_resp(&cqe).is_ok());
            }
        }
    }
}

/// Feeds `input` to a [`HostConn`] as described in the module documentation.
pub fn drive_host(input: &[u8]) -> Coverage {
    let mut cov = Coverage::default();
    let (head, stream) = parse_input(input);
    let opt = options(head[0]);
    let config = HostConfig {
        hdgst: opt.digests.header,
        ddgst: opt.digests.data,
        recv_buffer_size: 256,
        max_outstanding_commands: 8,
    };
    let mut h = HostConn::new(config);
    let sizes = (u32::from(head[3]) * 64 + 1, u32::from(head[4]) * 64 + 1);
    if opt.handshake {
        h.feed(PduHeader::ic_resp(0, opt.digests, FUZZ_MAXH2CDATA).as_bytes());
    }
    let mut split = Splitter(u32::from(u16::from_le_bytes([head[1], head[2]])));
    let mut pos = 0;
    let mut use_feed = false;
    loop {
        if h.is_closed() {
            return cov;
        }
        if let Err((e, before)) = host_events(&mut h, sizes, &mut cov) {
            let new_tx = h.pending_send()[before..].to_vec();
            let again = h.next_event().map(|_| ());
            check_failure(&e, &new_tx, PduType::H2cTermReq, again);
            cov.fatal_errors += 1;
            return cov;
        }
        let pending = h.pending_send().len();
        h.consume_sent(split.next(pending.max(1)).min(pending));
        if pos >= stream.len() {
            return cov;
        }
        let n = split.next(stream.len() - pos);
        let piece = &stream[pos..pos + n];
        pos += n;
        use_feed = !use_feed;
        if use_feed {
            h.feed(piece);
        } else {
            let buf = h.recv_buf(n);
            assert!(buf.len() >= n, "recv_buf must offer the requested room");
            buf[..n].copy_from_slice(piece);
            h.commit_recv(n);
        }
    }
}

/// The commands the host driver sends once connected: (cid, opcode, SGL length, in-capsule data).
pub fn fuzz_host_commands(read_len: u32, write_len: u32) -> [(u16, u8, u32, usize); 4] {
    [
        (0, 0x02, read_len, 0),
        (1, 0x01, write_len, 0),
        (2, 0x01, 16, 16),
        (3, 0x00, 0, 0),
    ]
}

/// A 64-byte SQE with the given opcode, command identifier and transport SGL length.
pub fn fuzz_sqe(cid: u16, opcode: u8, sgl_len: u32) -> [u8; 64] {
    let mut sqe = [0u8; 64];
    sqe[0] = opcode;
    sqe[1] = 0x40;
    sqe[2..4].copy_from_slice(&cid.to_le_bytes());
    sqe[32..36].copy_from_slice(&sgl_len.to_le_bytes());
    sqe[39] = 0x5A;
    sqe
}

/// Handles events until more bytes are needed; on a fatal error returns it with the length
/// of the send buffer just before the failing call.
fn host_events(
    h: &mut HostConn,
    sizes: (u32, u32),
    cov: &mut Coverage,
) -> Result<(), (ProtocolError, usize)> {
    loop {
        let mut connected = false;
        let mut r2t: Option<(u16, u16, u32, u32)> = None;
        let before = h.pending_send().len();
        match h.next_event().map_err(|e| (e, before))? {
            None => return Ok(()),
            Some(HostEvent::Connected(p)) => {
                assert_eq!(p.cpda, 0);
                assert!(p.maxh2cdata >= 4096 && p.maxh2cdata % 4 == 0);
                connected = true;
                cov.connected += 1;
            }
            Some(HostEvent::CapsuleResp { .. }) => cov.capsule_resps += 1,
            Some(HostEvent::C2HData { data, datao, .. }) => {
                cov.c2h_data += 1;
                assert!(!data.is_empty());
                assert!(datao.checked_add(data.len() as u32).is_some());
            }
            Some(HostEvent::C2HDataDigestError { .. }) => cov.digest_errors += 1,
            Some(HostEvent::R2T {
                cccid,
                ttag,
                r2to,
                r2tl,
            }) => {
                assert!(r2tl > 0);
                cov.r2ts += 1;
                r2t = Some((cccid, ttag, r2to, r2tl));
            }
            Some(HostEvent::TermReq { data, .. }) => {
                assert!(data.len() <= 128);
                cov.term_reqs += 1;
            }
        }
        if connected {
            for (cid, opcode, len, icd) in fuzz_host_commands(sizes.0, sizes.1) {
                let data = vec![0x5A; icd];
                let sent = h.send_capsule_cmd(&fuzz_sqe(cid, opcode, len), &data);
                assert!(sent.is_ok(), "{sent:?}");
            }
        }
        if let Some((cccid, ttag, r2to, r2tl)) = r2t {
            let data = vec![0x3C; r2tl as usize];
            let sent = h.send_h2c_data(cccid, ttag, r2to, &data, true);
            assert!(sent.is_ok(), "{sent:?}");
        }
    }
}

/// Well-formed driver inputs that walk through whole conversations, used as the starting
/// corpus of the fuzz targets: `(target_seeds, host_seeds)`. Each seed must run without a
/// fatal error.
pub fn seed_inputs() -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut target_seeds = Vec::new();
    let mut host_seeds = Vec::new();
    for bits in 0u8..4 {
        let d = Digests {
            header: bits & 1 != 0,
            data: bits & 2 != 0,
        };
        for handshake in [true, false] {
            let opts = bits | 0x04 | if handshake { 0x08 } else { 0 };

            // Target: ICReq, write with in-capsule data, write through an R2T answered by
            // two H2CData PDUs, a read, then the host terminates.
            let mut t = vec![opts, 0x34, 0x12, 0, 0];
            if !handshake {
                t.extend_from_slice(PduHeader::ic_req(0, d, 0).as_bytes());
            }
            let put = |out: &mut Vec<u8>, h: Result<PduHeader, crate::SendError>, data: &[u8]| {
                if let Ok(h) = h {
                    h.append_to(out, data);
                }
            };
            put(
                &mut t,
                PduHeader::capsule_cmd(d, 0, &fuzz_sqe(1, 0x01, 100), 100),
                &[1; 100],
            );
            put(
                &mut t,
                PduHeader::capsule_cmd(d, 0, &fuzz_sqe(2, 0x01, 6000), 0),
                &[],
            );
            put(
                &mut t,
                PduHeader::h2c_data(d, 0, 2, 2, 0, 4096, false),
                &[2; 4096],
            );
            put(
                &mut t,
                PduHeader::h2c_data(d, 0, 2, 2, 4096, 1904, true),
                &[2; 1904],
            );
            put(
                &mut t,
                PduHeader::capsule_cmd(d, 0, &fuzz_sqe(3, 0x02, 5000), 0),
                &[],
            );
            let term = PduHeader::term_req(
                nvme_spec::tcp::PduType::H2cTermReq,
                nvme_spec::tcp::FatalErrorStatus::PduSequenceError,
                0,
                8,
            );
            t.extend_from_slice(term.as_bytes());
            t.extend_from_slice(&[0; 8]);
            target_seeds.push(t);

            // Host: ICResp, the read (command 0, 1281 bytes) in two C2HData PDUs, the write
            // (command 1, 1921 bytes) through an R2T, responses for all four commands, then
            // the controller terminates.
            let mut h = vec![opts, 0x78, 0x56, 20, 30];
            if !handshake {
                h.extend_from_slice(PduHeader::ic_resp(0, d, FUZZ_MAXH2CDATA).as_bytes());
            }
            put(
                &mut h,
                PduHeader::c2h_data(d, 0, 0, 0, 1000, false, false),
                &[3; 1000],
            );
            put(
                &mut h,
                PduHeader::c2h_data(d, 0, 0, 1000, 281, true, false),
                &[3; 281],
            );
            put(&mut h, Ok(PduHeader::r2t(d, 1, 7, 0, 1921)), &[]);
            for cid in 0..4u16 {
                let mut cqe = [0u8; 16];
                cqe[12..14].copy_from_slice(&cid.to_le_bytes());
                put(&mut h, Ok(PduHeader::capsule_resp(d, &cqe)), &[]);
            }
            let term = PduHeader::term_req(
                nvme_spec::tcp::PduType::C2hTermReq,
                nvme_spec::tcp::FatalErrorStatus::HeaderDigestError,
                0,
                0,
            );
            h.extend_from_slice(term.as_bytes());
            host_seeds.push(h);
        }
    }
    (target_seeds, host_seeds)
}
