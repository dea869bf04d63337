//! A full host <-> target conversation through the two engines, with the bytes handed over
//! whole, one at a time, and in random pieces, with and without digests.

mod common;

use common::*;
use nvmf_tcp::{Digests, HostConn, TargetConn};
use proptest::prelude::*;

const ALL_DIGESTS: [Digests; 4] = [
    Digests {
        header: false,
        data: false,
    },
    Digests {
        header: true,
        data: false,
    },
    Digests {
        header: false,
        data: true,
    },
    Digests {
        header: true,
        data: true,
    },
];

/// Write with in-capsule data, two reads (one split over several C2HData PDUs and calls,
/// one ending with SUCCESS), a write through two R2Ts, and a command without data.
fn conversation(d: Digests, split: Split<'_>) {
    let (mut h, mut t) = connect(d, split);

    // 1. Write with 600 bytes of in-capsule data.
    let icd = pattern(600, 1);
    let s1 = sqe(0x01, 1, SGL_ICD, 600);
    h.send_capsule_cmd(&s1, &icd).unwrap();
    let ev = to_target(&mut t, &take_host_tx(&mut h), split);
    assert_eq!(ev, vec![TEv::Command { sqe: s1, data: icd }]);
    t.send_capsule_resp(&cqe(1, 0)).unwrap();
    let ev = to_host(&mut h, &take_target_tx(&mut t), split);
    assert_eq!(ev, vec![HEv::CapsuleResp { cqe: cqe(1, 0) }]);

    // 2. Read of 10000 bytes sent in two calls, split at 4096-byte C2HData PDUs.
    let read = pattern(10_000, 2);
    let s2 = sqe(0x02, 2, SGL_TCP, 10_000);
    h.send_capsule_cmd(&s2, &[]).unwrap();
    let ev = to_target(&mut t, &take_host_tx(&mut h), split);
    assert_eq!(
        ev,
        vec![TEv::Command {
            sqe: s2,
            data: vec![]
        }]
    );
    t.send_c2h_data(2, 0, &read[..6000], false, false).unwrap();
    t.send_c2h_data(2, 6000, &read[6000..], true, false)
        .unwrap();
    t.send_capsule_resp(&cqe(2, 7)).unwrap();
    let ev = to_host(&mut h, &take_target_tx(&mut t), split);
    let (data, last, success) = collect_c2h(&ev, 2);
    assert_eq!(data, read);
    assert!(last && !success);
    assert_eq!(ev.last(), Some(&HEv::CapsuleResp { cqe: cqe(2, 7) }));
    assert_eq!(
        ev.iter()
            .filter(|e| matches!(e, HEv::C2h { last: true, .. }))
            .count(),
        1
    );

    // 3. Read of 5000 bytes completed by SUCCESS: no CapsuleResp.
    let read3 = pattern(5000, 3);
    h.send_capsule_cmd(&sqe(0x02, 3, SGL_TCP, 5000), &[])
        .unwrap();
    let ev = to_target(&mut t, &take_host_tx(&mut h), split);
    assert_eq!(ev.len(), 1);
    t.send_c2h_data(3, 0, &read3, true, true).unwrap();
    let ev = to_host(&mut h, &take_target_tx(&mut t), split);
    let (data, last, success) = collect_c2h(&ev, 3);
    assert_eq!(data, read3);
    assert!(last && success);
    assert!(ev.iter().all(|e| matches!(e, HEv::C2h { .. })));

    // 4. Write of 20000 bytes through two R2Ts (12000 then 8000 bytes).
    let write = pattern(20_000, 4);
    let s4 = sqe(0x01, 4, SGL_TCP, 20_000);
    h.send_capsule_cmd(&s4, &[]).unwrap();
    let ev = to_target(&mut t, &take_host_tx(&mut h), split);
    assert_eq!(
        ev,
        vec![TEv::Command {
            sqe: s4,
            data: vec![]
        }]
    );
    let mut received = Vec::new();
    for (ttag, r2to, r2tl) in [(9u16, 0u32, 12_000u32), (10, 12_000, 8000)] {
        t.send_r2t(4, ttag, r2to, r2tl).unwrap();
        let ev = to_host(&mut h, &take_target_tx(&mut t), split);
        assert_eq!(
            ev,
            vec![HEv::R2t {
                cccid: 4,
                ttag,
                r2to,
                r2tl
            }]
        );
        let range = r2to as usize..(r2to + r2tl) as usize;
        if ttag == 9 {
            // One call, split by MAXH2CDATA (8192) into two PDUs.
            h.send_h2c_data(4, ttag, r2to, &write[range], true).unwrap();
        } else {
            // Two calls.
            let mid = range.start + 3000;
            h.send_h2c_data(4, ttag, r2to, &write[range.start..mid], false)
                .unwrap();
            h.send_h2c_data(4, ttag, mid as u32, &write[mid..range.end], true)
                .unwrap();
        }
        let ev = to_target(&mut t, &take_host_tx(&mut h), split);
        let mut lasts = 0;
        for e in &ev {
            let TEv::H2c {
                cccid,
                ttag: tt,
                datao,
                data,
                last,
            } = e
            else {
                panic!("unexpected event {e:?}")
            };
            assert_eq!((*cccid, *tt), (4, ttag));
            assert_eq!(*datao as usize, received.len());
            assert!(data.len() <= 8192);
            received.extend_from_slice(data);
            lasts += usize::from(*last);
        }
        assert_eq!(lasts, 1);
        assert!(matches!(ev.last(), Some(TEv::H2c { last: true, .. })));
    }
    assert_eq!(received, write);
    assert_eq!(t.outstanding_r2ts(), 0);
    t.send_capsule_resp(&cqe(4, 0)).unwrap();
    let ev = to_host(&mut h, &take_target_tx(&mut t), split);
    assert_eq!(ev, vec![HEv::CapsuleResp { cqe: cqe(4, 0) }]);

    // 5. A command without data, and several PDUs in one delivery.
    h.send_capsule_cmd(&sqe(0x00, 5, 0, 0), &[]).unwrap();
    h.send_capsule_cmd(&sqe(0x00, 6, 0, 0), &[]).unwrap();
    let ev = to_target(&mut t, &take_host_tx(&mut h), split);
    assert_eq!(ev.len(), 2);
    t.send_capsule_resp(&cqe(6, 0)).unwrap();
    t.send_capsule_resp(&cqe(5, 0)).unwrap();
    let ev = to_host(&mut h, &take_target_tx(&mut t), split);
    assert_eq!(
        ev,
        vec![
            HEv::CapsuleResp { cqe: cqe(6, 0) },
            HEv::CapsuleResp { cqe: cqe(5, 0) }
        ]
    );

    assert_eq!(h.outstanding_commands(), 0);
    assert!(!h.is_closed() && !t.is_closed());
    finish_clean(&mut h, &mut t);
}

fn finish_clean(h: &mut HostConn, t: &mut TargetConn) {
    assert!(h.next_event().unwrap().is_none());
    assert!(t.next_event().unwrap().is_none());
    assert!(h.pending_send().is_empty() && t.pending_send().is_empty());
}

#[test]
fn whole_buffers() {
    for d in ALL_DIGESTS {
        conversation(d, &mut |n| n);
    }
}

#[test]
fn one_byte_at_a_time() {
    for d in ALL_DIGESTS {
        conversation(d, &mut |_| 1);
    }
}

#[test]
fn odd_fixed_pieces() {
    for d in ALL_DIGESTS {
        for size in [3usize, 7, 23, 77, 1000] {
            conversation(d, &mut |_| size);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_pieces(sizes in proptest::collection::vec(1usize..600, 1..64), d in 0usize..4) {
        let mut i = 0;
        conversation(ALL_DIGESTS[d], &mut |_| {
            i += 1;
            sizes[i % sizes.len()]
        });
    }
}

/// Read data written in place (`send_c2h_data_with`) is byte for byte what `send_c2h_data`
/// queues for the same data, split over PDUs the same way; a failing fill queues nothing.
#[test]
fn c2h_data_written_in_place_matches_copied() {
    for d in ALL_DIGESTS {
        for len in [512usize, 4096, 4097, 3 * 4096 + 100] {
            let data = pattern(len, 9);
            let (_h, mut a) = connect(d, &mut |n| n);
            let (_h, mut b) = connect(d, &mut |n| n);
            a.send_c2h_data(5, 0, &data, true, true).unwrap();
            let mut offsets = Vec::new();
            b.send_c2h_data_with(5, len as u32, true, |off, out| {
                offsets.push((off, out.len()));
                out.copy_from_slice(&data[off..off + out.len()]);
                Ok::<(), ()>(())
            })
            .unwrap()
            .unwrap();
            assert_eq!(
                take_target_tx(&mut a),
                take_target_tx(&mut b),
                "{d:?} {len}"
            );
            assert_eq!(offsets[0], (0, len.min(4096)));

            b.send_capsule_resp(&cqe(1, 0)).unwrap();
            let before = b.pending_send().to_vec();
            let r = b.send_c2h_data_with(6, len as u32, false, |off, _| {
                if off > 0 {
                    Err("backend failed")
                } else {
                    Ok(())
                }
            });
            if len > 4096 {
                assert_eq!(r.unwrap(), Err("backend failed"));
                assert_eq!(b.pending_send(), &before[..], "nothing queued on failure");
            }
        }
    }
}

/// Read data sent from shared buffers (`send_c2h_data_shared`) is byte for byte what
/// `send_c2h_data` queues for the same data, however the pieces fall across PDU boundaries;
/// the pieces are held until sent, the completion counts until its last byte has left, and
/// pieces that do not add up to the length queue nothing.
#[test]
fn c2h_data_sent_from_shared_buffers_matches_copied() {
    use std::sync::Arc;
    for d in ALL_DIGESTS {
        for len in [512usize, 4096, 4097, 3 * 4096 + 100] {
            for piece in [100usize, 4096, 5000, len] {
                let data = pattern(len, 3);
                let (_h, mut a) = connect(d, &mut |n| n);
                let (_h, mut b) = connect(d, &mut |n| n);
                a.send_capsule_resp(&cqe(1, 0)).unwrap();
                a.send_c2h_data(5, 0, &data, true, true).unwrap();
                a.send_capsule_resp(&cqe(2, 0)).unwrap();
                let shared: Vec<(Arc<[u8]>, core::ops::Range<usize>)> = data
                    .chunks(piece)
                    .map(|c| {
                        // Each piece in the middle of a larger buffer.
                        let mut buf = vec![0xEE; 7];
                        buf.extend_from_slice(c);
                        buf.extend_from_slice(&[0xDD; 5]);
                        (Arc::from(buf), 7..7 + c.len())
                    })
                    .collect();
                b.send_capsule_resp(&cqe(1, 0)).unwrap();
                b.send_c2h_data_shared(5, len as u32, true, &shared)
                    .unwrap();
                b.send_capsule_resp(&cqe(2, 0)).unwrap();
                assert!(
                    shared.iter().all(|(p, _)| Arc::strong_count(p) >= 2),
                    "queued pieces are held"
                );
                assert_eq!(
                    take_target_tx(&mut a),
                    take_target_tx(&mut b),
                    "{d:?} {len} {piece}"
                );
                assert!(
                    shared.iter().all(|(p, _)| Arc::strong_count(p) == 1),
                    "sent pieces are released"
                );

                // Too few or too many bytes: refused, nothing queued.
                let short = &shared[..shared.len() - 1];
                let extra: Vec<_> = shared.iter().chain(&shared[..1]).cloned().collect();
                for pieces in [short, &extra[..]] {
                    if pieces.is_empty() {
                        continue;
                    }
                    assert_eq!(
                        b.send_c2h_data_shared(6, len as u32, true, pieces),
                        Err(nvmf_tcp::SendError::TooLarge)
                    );
                    assert_eq!(b.pending_send_len(), 0, "nothing queued on refusal");
                }
            }
        }
    }
}

/// A completion sent with shared read data (SUCCESS in the last C2HData) counts against the
/// queue size until its last byte has been sent.
#[test]
fn shared_read_data_completes_only_once_sent() {
    use std::sync::Arc;
    let (mut h, mut t) = connect(Digests::default(), &mut |n| n);
    let before = t.outstanding_commands();
    let data: Arc<[u8]> = pattern(10_000, 1).into();
    h.send_capsule_cmd(&sqe(0x02, 9, SGL_TCP, 10_000), &[])
        .unwrap();
    let _ = to_target(&mut t, &take_host_tx(&mut h), &mut |n| n);
    assert_eq!(t.outstanding_commands(), before + 1);
    t.send_c2h_data_shared(9, 10_000, true, &[(Arc::clone(&data), 0..10_000)])
        .unwrap();
    let total = t.pending_send_len();
    t.consume_sent(total - 1);
    assert_eq!(t.outstanding_commands(), before + 1, "one byte left");
    t.consume_sent(1);
    assert_eq!(t.outstanding_commands(), before);
}

/// Delivers `wire` to the host as a socket would with reads of `chunk` bytes: whenever the
/// engine reports pending C2HData, the bytes go straight into `buf` (as the initiator reads
/// them into the command's buffer) and are committed; everything else goes through the
/// receive buffer. Returns the events (in-buffer data pieces copied into `buf` too) and the
/// number of bytes that were received in place.
fn to_host_in_place(
    h: &mut nvmf_tcp::HostConn,
    wire: &[u8],
    chunk: usize,
    buf: &mut [u8],
) -> (Vec<HEv>, Vec<nvmf_tcp::DataCommit>, usize) {
    let mut events = Vec::new();
    let mut commits = Vec::new();
    let mut in_place = 0;
    let mut pos = 0;
    while pos < wire.len() {
        if let Some(p) = h.pending_data() {
            let n = chunk.min(p.len).min(wire.len() - pos);
            let dst = &mut buf[p.datao as usize..p.datao as usize + n];
            dst.copy_from_slice(&wire[pos..pos + n]);
            commits.push(h.commit_data(dst));
            in_place += n;
            pos += n;
        } else {
            let n = chunk.min(wire.len() - pos);
            h.recv_buf(n)[..n].copy_from_slice(&wire[pos..pos + n]);
            h.commit_recv(n);
            pos += n;
        }
        while let Some(ev) = h.next_event().expect("host protocol error") {
            if let nvmf_tcp::HostEvent::C2HData { datao, data, .. } = &ev {
                buf[*datao as usize..*datao as usize + data.len()].copy_from_slice(data);
            }
            events.push(ev.into());
        }
    }
    (events, commits, in_place)
}

/// C2HData received straight into the command's buffer (`pending_data`/`commit_data`) gives
/// the same data and the same end of the transfer as through the receive buffer, with every
/// digest setting and socket read size; a corrupted byte received in place still fails the
/// data digest.
#[test]
fn c2h_data_received_in_place() {
    for d in ALL_DIGESTS {
        for chunk in [1usize, 100, 4096, 5000, 1 << 20] {
            let len = 3 * 4096 + 100;
            let data = pattern(len, 11);
            let (mut h, mut t) = connect(d, &mut |n| n);
            h.send_capsule_cmd(&sqe(0x02, 7, SGL_TCP, len as u32), &[])
                .unwrap();
            let _ = to_target(&mut t, &take_host_tx(&mut h), &mut |n| n);
            t.send_c2h_data(7, 0, &data, true, true).unwrap();
            let wire = take_target_tx(&mut t);
            let mut buf = vec![0u8; len];
            let (events, commits, in_place) = to_host_in_place(&mut h, &wire, chunk, &mut buf);
            assert_eq!(buf, data, "{d:?} chunk {chunk}");
            if chunk < 4096 {
                assert!(
                    in_place > 0,
                    "{d:?} chunk {chunk}: nothing received in place"
                );
            }
            // The end of the transfer is reported exactly once: by commit_data when the last
            // byte came in place without a digest, otherwise by an event.
            let ended_by_commit = commits
                .iter()
                .filter(|c| {
                    matches!(
                        c,
                        nvmf_tcp::DataCommit::End {
                            last: true,
                            success: true
                        }
                    )
                })
                .count();
            let ended_by_event = events
                .iter()
                .filter(|e| {
                    matches!(
                        e,
                        HEv::C2h {
                            last: true,
                            success: true,
                            ..
                        }
                    )
                })
                .count();
            assert_eq!(ended_by_commit + ended_by_event, 1, "{d:?} chunk {chunk}");
            if d.data {
                assert_eq!(
                    ended_by_commit, 0,
                    "a digest ends every PDU through an event"
                );
            }
            assert!(h.pending_data().is_none());
            assert_eq!(h.outstanding_commands(), 0);

            if d.data && chunk == 100 {
                // Corrupt a byte inside the in-place part of the next read.
                h.send_capsule_cmd(&sqe(0x02, 8, SGL_TCP, 4096), &[])
                    .unwrap();
                let _ = to_target(&mut t, &take_host_tx(&mut h), &mut |n| n);
                t.send_c2h_data(8, 0, &data[..4096], true, true).unwrap();
                let mut wire = take_target_tx(&mut t);
                let hdr = wire.len() - 4096 - 4;
                wire[hdr + 3000] ^= 0x40;
                let mut buf = vec![0u8; 4096];
                let (events, _, in_place) = to_host_in_place(&mut h, &wire, chunk, &mut buf);
                assert!(in_place > 0);
                assert!(
                    events
                        .iter()
                        .any(|e| matches!(e, HEv::C2hDigestError { cccid: 8, .. })),
                    "{events:?}"
                );
            }
        }
    }
}

/// Until the ICReq is accepted a connection holds no more receive space than the ICReq needs
/// (a flood of connections that never finish it costs little memory); afterwards only what
/// the host sends.
/// C2HData kept where it was received (`keep_last_data`) stays as it arrived while the host
/// goes on receiving (into other backing stores once the one holding it would be written
/// again), with and without digests; what is kept is what the event and `last_data` showed;
/// once bytes were received after the event, nothing is kept.
#[test]
fn c2h_data_kept_where_it_was_received() {
    for d in ALL_DIGESTS {
        let (mut h, mut t) = connect(d, &mut |n| n);
        let mut kept = Vec::new();
        for round in 0..6u8 {
            for cid in 0..4u16 {
                h.send_capsule_cmd(&sqe(0x02, cid, SGL_TCP, 100), &[])
                    .unwrap();
            }
            let _ = to_target(&mut t, &take_host_tx(&mut h), &mut |n| n);
            for cid in 0..4u16 {
                let data = pattern(100, round * 4 + cid as u8);
                t.send_c2h_data(cid, 0, &data, true, true).unwrap();
            }
            let wire = take_target_tx(&mut t);
            // Received the way a socket is read: as much as the spare room takes.
            let mut pos = 0;
            while pos < wire.len() {
                let buf = h.recv_buf(1);
                let n = buf.len().min(wire.len() - pos);
                buf[..n].copy_from_slice(&wire[pos..pos + n]);
                h.commit_recv(n);
                pos += n;
                loop {
                    let got = match h.next_event().expect("host protocol error") {
                        None => break,
                        Some(nvmf_tcp::HostEvent::C2HData { data, .. }) => data.to_vec(),
                        Some(_) => continue,
                    };
                    assert_eq!(h.last_data(), &got[..]);
                    if let Some(k) = h.keep_last_data() {
                        kept.push((got, k));
                    }
                }
            }
            assert_eq!(h.outstanding_commands(), 0, "{d:?} round {round}");
        }
        assert!(kept.len() >= 4, "{d:?}: kept {}", kept.len());
        for (got, k) in &kept {
            assert_eq!(k.as_slice(), &got[..], "{d:?}");
        }
        let _ = h.recv_buf(1);
        assert!(h.last_data().is_empty());
        assert!(h.keep_last_data().is_none());
    }
}

#[test]
fn receive_space_is_small_until_the_icreq() {
    let mut h = HostConn::new(host_config(ALL_DIGESTS[0]));
    let icreq = take_host_tx(&mut h);
    let mut t = TargetConn::new(target_config()).expect("valid config");
    assert_eq!(t.recv_hint(256 * 1024), 128);
    assert_eq!(t.recv_buf(t.recv_hint(256 * 1024)).len(), 128);
    t.feed(&icreq[..8]);
    assert!(t.next_event().unwrap().is_none());
    assert_eq!(t.recv_hint(256 * 1024), 120);
    assert_eq!(t.recv_buf(120).len(), 120);
    let rest = &icreq[8..];
    t.recv_buf(rest.len())[..rest.len()].copy_from_slice(rest);
    t.commit_recv(rest.len());
    assert!(matches!(
        t.next_event().unwrap(),
        Some(nvmf_tcp::TargetEvent::Connected(_))
    ));
    // Established: reads start small (the configured size here) and grow as the host sends.
    assert_eq!(t.recv_hint(256 * 1024), target_config().recv_buffer_size);
    assert!(t.recv_buf(1).len() < 2048, "no room reserved up front");
}
