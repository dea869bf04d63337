//! Loopback harness: a host and a target connected through byte buffers.
#![allow(dead_code)]

use nvmf_tcp::{
    Digests, HostConfig, HostConn, HostEvent, HostParams, TargetConfig, TargetConn, TargetEvent,
    TargetParams,
};

/// An owned copy of a [`TargetEvent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TEv {
    Connected(TargetParams),
    Command {
        sqe: [u8; 64],
        data: Vec<u8>,
    },
    CommandDigestError {
        sqe: [u8; 64],
    },
    H2c {
        cccid: u16,
        ttag: u16,
        datao: u32,
        data: Vec<u8>,
        last: bool,
    },
    H2cDigestError {
        cccid: u16,
        ttag: u16,
        datao: u32,
        datal: u32,
        last: bool,
    },
    TermReq {
        fes: u16,
        fei: u32,
        data: Vec<u8>,
    },
}

impl From<TargetEvent<'_>> for TEv {
    fn from(e: TargetEvent<'_>) -> Self {
        match e {
            TargetEvent::Connected(p) => TEv::Connected(p),
            TargetEvent::Command { sqe, data } => TEv::Command {
                sqe,
                data: data.to_vec(),
            },
            TargetEvent::CommandDataDigestError { sqe } => TEv::CommandDigestError { sqe },
            TargetEvent::H2CData {
                cccid,
                ttag,
                datao,
                data,
                last,
            } => TEv::H2c {
                cccid,
                ttag,
                datao,
                data: data.to_vec(),
                last,
            },
            TargetEvent::H2CDataDigestError {
                cccid,
                ttag,
                datao,
                datal,
                last,
            } => TEv::H2cDigestError {
                cccid,
                ttag,
                datao,
                datal,
                last,
            },
            TargetEvent::TermReq { fes, fei, data } => TEv::TermReq {
                fes,
                fei,
                data: data.to_vec(),
            },
        }
    }
}

/// An owned copy of a [`HostEvent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HEv {
    Connected(HostParams),
    CapsuleResp {
        cqe: [u8; 16],
    },
    C2h {
        cccid: u16,
        datao: u32,
        data: Vec<u8>,
        last: bool,
        success: bool,
    },
    C2hDigestError {
        cccid: u16,
        last: bool,
        success: bool,
    },
    R2t {
        cccid: u16,
        ttag: u16,
        r2to: u32,
        r2tl: u32,
    },
    TermReq {
        fes: u16,
        fei: u32,
        data: Vec<u8>,
    },
}

impl From<HostEvent<'_>> for HEv {
    fn from(e: HostEvent<'_>) -> Self {
        match e {
            HostEvent::Connected(p) => HEv::Connected(p),
            HostEvent::CapsuleResp { cqe } => HEv::CapsuleResp { cqe },
            HostEvent::C2HData {
                cccid,
                datao,
                data,
                last,
                success,
            } => HEv::C2h {
                cccid,
                datao,
                data: data.to_vec(),
                last,
                success,
            },
            HostEvent::C2HDataDigestError {
                cccid,
                last,
                success,
            } => HEv::C2hDigestError {
                cccid,
                last,
                success,
            },
            HostEvent::R2T {
                cccid,
                ttag,
                r2to,
                r2tl,
            } => HEv::R2t {
                cccid,
                ttag,
                r2to,
                r2tl,
            },
            HostEvent::TermReq { fes, fei, data } => HEv::TermReq {
                fes,
                fei,
                data: data.to_vec(),
            },
        }
    }
}

/// Chooses how many bytes to hand over next.
pub type Split<'a> = &'a mut dyn FnMut(usize) -> usize;

/// Delivers `bytes` to the target in pieces, alternating `recv_buf`/`commit_recv` and
/// `feed`, and collects every event.
pub fn to_target(t: &mut TargetConn, bytes: &[u8], split: Split<'_>) -> Vec<TEv> {
    let mut out = Vec::new();
    let mut pos = 0;
    let mut flip = false;
    while pos < bytes.len() {
        let n = split(bytes.len() - pos).clamp(1, bytes.len() - pos);
        flip = !flip;
        if flip {
            let buf = t.recv_buf(n);
            buf[..n].copy_from_slice(&bytes[pos..pos + n]);
            t.commit_recv(n);
        } else {
            t.feed(&bytes[pos..pos + n]);
        }
        pos += n;
        while let Some(ev) = t.next_event().expect("target protocol error") {
            out.push(ev.into());
        }
    }
    out
}

/// Delivers `bytes` to the host in pieces and collects every event.
pub fn to_host(h: &mut HostConn, bytes: &[u8], split: Split<'_>) -> Vec<HEv> {
    let mut out = Vec::new();
    let mut pos = 0;
    let mut flip = false;
    while pos < bytes.len() {
        let n = split(bytes.len() - pos).clamp(1, bytes.len() - pos);
        flip = !flip;
        if flip {
            let buf = h.recv_buf(n);
            buf[..n].copy_from_slice(&bytes[pos..pos + n]);
            h.commit_recv(n);
        } else {
            h.feed(&bytes[pos..pos + n]);
        }
        pos += n;
        while let Some(ev) = h.next_event().expect("host protocol error") {
            out.push(ev.into());
        }
    }
    out
}

/// Takes everything the target queued (in every slice), consuming it in two steps.
pub fn take_target_tx(t: &mut TargetConn) -> Vec<u8> {
    let bytes: Vec<u8> = t.pending_send_slices().flatten().copied().collect();
    assert_eq!(t.pending_send_len(), bytes.len());
    let half = bytes.len() / 2;
    t.consume_sent(half);
    let rest: Vec<u8> = t.pending_send_slices().flatten().copied().collect();
    assert_eq!(rest, &bytes[half..]);
    t.consume_sent(bytes.len() - half);
    assert!(t.pending_send().is_empty());
    assert_eq!(t.pending_send_len(), 0);
    bytes
}

/// Takes everything the host queued.
pub fn take_host_tx(h: &mut HostConn) -> Vec<u8> {
    let bytes = h.pending_send().to_vec();
    let half = bytes.len() / 2;
    h.consume_sent(half);
    assert_eq!(h.pending_send(), &bytes[half..]);
    h.consume_sent(bytes.len() - half);
    assert!(h.pending_send().is_empty());
    bytes
}

/// A 64-byte SQE: opcode, command identifier, SGL1 with the given identifier and length.
pub fn sqe(opcode: u8, cid: u16, sgl_id: u8, len: u32) -> [u8; 64] {
    let mut s = [0u8; 64];
    s[0] = opcode;
    s[1] = 0x40;
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s[4] = 1;
    s[32..36].copy_from_slice(&len.to_le_bytes());
    s[39] = sgl_id;
    s
}

/// SGL identifier of in-capsule data (data block, offset subtype).
pub const SGL_ICD: u8 = 0x01;
/// SGL identifier of a transport data block (NVMe/TCP data via C2HData/R2T).
pub const SGL_TCP: u8 = 0x5A;

/// A 16-byte CQE completing `cid`.
pub fn cqe(cid: u16, dw0: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[..4].copy_from_slice(&dw0.to_le_bytes());
    c[12..14].copy_from_slice(&cid.to_le_bytes());
    c
}

/// Deterministic test data.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Target configuration used by the conversation tests.
pub fn target_config() -> TargetConfig {
    TargetConfig {
        maxh2cdata: 8192,
        max_in_capsule_data: 8192,
        allow_digests: true,
        max_c2h_data: 4096,
        recv_buffer_size: 1024,
        queue_size: 128,
    }
}

/// Host configuration with the given digests.
pub fn host_config(d: Digests) -> HostConfig {
    HostConfig {
        hdgst: d.header,
        ddgst: d.data,
        recv_buffer_size: 512,
        max_outstanding_commands: 8,
    }
}

/// Runs the ICReq/ICResp exchange and checks both sides report the same parameters.
pub fn connect(d: Digests, split: Split<'_>) -> (HostConn, TargetConn) {
    let mut h = HostConn::new(host_config(d));
    let mut t = TargetConn::new(target_config()).expect("valid config");
    let icreq = take_host_tx(&mut h);
    assert_eq!(icreq.len(), 128);
    let ev = to_target(&mut t, &icreq, split);
    assert_eq!(
        ev,
        vec![TEv::Connected(TargetParams {
            digests: d,
            hpda: 0,
            maxr2t: 0
        })]
    );
    let icresp = take_target_tx(&mut t);
    let ev = to_host(&mut h, &icresp, split);
    assert_eq!(
        ev,
        vec![HEv::Connected(HostParams {
            digests: d,
            maxh2cdata: 8192,
            cpda: 0
        })]
    );
    (h, t)
}

/// Reassembles C2HData pieces for one command; returns (data, saw_last, success).
pub fn collect_c2h(events: &[HEv], cid: u16) -> (Vec<u8>, bool, bool) {
    let mut data = Vec::new();
    let mut last_seen = false;
    let mut success = false;
    for e in events {
        if let HEv::C2h {
            cccid,
            datao,
            data: d,
            last,
            success: s,
        } = e
        {
            if *cccid != cid {
                continue;
            }
            assert!(!last_seen, "data after LAST_PDU");
            assert_eq!(*datao as usize, data.len(), "pieces arrive in order");
            data.extend_from_slice(d);
            last_seen |= *last;
            success |= *s;
            if *s {
                assert!(*last);
            }
        }
    }
    (data, last_seen, success)
}
