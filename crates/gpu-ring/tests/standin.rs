//! The ring protocol end to end: the host side (`HostRing`) served by test code, the device
//! side played by the CPU stand-in with threads as warps.

use nvmeof_gpu_ring as gpu_ring;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::Duration;

use gpu_ring::proto::status;
use gpu_ring::standin::{DeviceRing, WarpRequest};
use gpu_ring::{DataMode, HostRing, NsBinding, Read, RingConfig, RingSet};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const LONG: Duration = Duration::from_secs(30);

const NS: [NsBinding; 2] = [
    NsBinding {
        nsid: 1,
        block_size: 512,
        blocks: 1 << 20,
    },
    NsBinding {
        nsid: 9,
        block_size: 4096,
        blocks: 64,
    },
];

fn ring(slots: u32, slot_bytes: u32, mode: DataMode) -> (HostRing, DeviceRing) {
    let mut set = RingSet::new_host(
        1,
        RingConfig {
            slots,
            slot_bytes,
            mode,
        },
        &NS,
    )
    .unwrap();
    let host = set.take_host_rings().pop().unwrap();
    let dev = set.standin_rings().pop().unwrap();
    (host, dev)
}

/// The bytes of namespace `nsid` at `lba`: 8-byte words `nsid << 48 | byte offset`.
fn pattern(nsid: u32, block_size: u32, lba: u64, buf: &mut [u8]) {
    let base = lba * u64::from(block_size);
    for (i, w) in buf.chunks_mut(8).enumerate() {
        let v = (u64::from(nsid) << 48) | (base + 8 * i as u64);
        w.copy_from_slice(&v.to_le_bytes()[..w.len()]);
    }
}

fn expect(ns: usize, lba: u64, nblocks: u32) -> Vec<u8> {
    let b = &NS[ns];
    let mut v = vec![0; (nblocks * b.block_size) as usize];
    pattern(b.nsid, b.block_size, lba, &mut v);
    v
}

/// Serves one read from the "namespace": the pattern into the slot, then completes it.
fn serve(host: &mut HostRing, r: &Read) {
    let bs = (r.bytes / r.nblocks as usize) as u32;
    pattern(r.nsid, bs, r.lba, &mut host.data_mut(r.slot)[..r.bytes]);
    host.complete(r.slot, status::SUCCESS);
}

fn poll_all(host: &mut HostRing) -> Vec<Read> {
    let mut out = Vec::new();
    host.poll(usize::MAX, &mut out);
    out
}

#[test]
fn a_read_round_trip_delivers_the_bytes() {
    let (mut host, dev) = ring(4, 8192, DataMode::Pull);
    let t = dev.submit(1, 3, 2, 0);
    assert!(!dev.test(&t));
    let reads = poll_all(&mut host);
    assert_eq!(
        reads,
        vec![Read {
            slot: 0,
            nsid: 9,
            lba: 3,
            nblocks: 2,
            bytes: 8192
        }]
    );
    assert_eq!(host.in_flight(), 1);
    serve(&mut host, &reads[0]);
    assert!(dev.test(&t));
    let mut buf = vec![0; 8192];
    assert_eq!(dev.wait(t, LONG, &mut buf), 0);
    assert_eq!(buf, expect(1, 3, 2));
    let s = host.stats();
    assert_eq!((s.taken, s.completed, s.invalid, s.in_flight), (1, 1, 0, 0));
}

#[test]
fn many_laps_wrap_the_lap_counter() {
    // Two slots: 2 * 65535 tickets cover every lap of both slots, then wrap to lap 1 again.
    let (mut host, dev) = ring(2, 512, DataMode::Pull);
    let total = 2 * 65535 + 8;
    let mut buf = [0u8; 512];
    let mut out = Vec::new();
    for i in 0..total {
        let lba = i % 1000;
        let t = dev.submit(0, lba, 1, 0);
        assert_eq!(t.value(), i);
        out.clear();
        assert_eq!(host.poll(8, &mut out), 1, "ticket {i}");
        serve(&mut host, &out[0]);
        assert_eq!(dev.wait(t, LONG, &mut buf), 0);
        let first = u64::from_le_bytes(buf[..8].try_into().unwrap());
        assert_eq!(first, (1 << 48) | (lba * 512), "ticket {i}");
    }
    assert_eq!(host.next_ticket(), total);
    assert_eq!(host.stats().completed, total);
}

#[test]
fn completions_in_any_order_reach_their_waiters() {
    let (mut host, dev) = ring(8, 4096, DataMode::Pull);
    let mut rng = StdRng::seed_from_u64(13);
    for round in 0..200u64 {
        let reqs: Vec<WarpRequest> = (0..8)
            .map(|i| WarpRequest {
                ns: 0,
                lba: round * 64 + i * 8,
                nblocks: 1 + (i as u32 % 8),
                dst: 0,
            })
            .collect();
        let before = dev.tickets();
        let tickets = dev.submit_warp(&reqs);
        assert_eq!(dev.tickets(), before + 8);
        let mut reads = poll_all(&mut host);
        assert_eq!(reads.len(), 8);
        reads.shuffle(&mut rng);
        // Complete half, wait for those, then the rest: waiters see only their own data.
        let mut waits: Vec<(usize, _)> = tickets.into_iter().enumerate().collect();
        waits.shuffle(&mut rng);
        for r in &reads {
            serve(&mut host, r);
        }
        for (i, t) in waits {
            let mut buf = vec![0; 4096];
            assert_eq!(dev.wait(t, LONG, &mut buf), 0);
            let n = (reqs[i].nblocks * 512) as usize;
            assert_eq!(buf[..n], expect(0, reqs[i].lba, reqs[i].nblocks)[..]);
        }
    }
}

#[test]
fn threads_as_warps_share_a_ring() {
    let (mut host, dev) = ring(16, 4096, DataMode::Pull);
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(7);
            let mut pending = Vec::new();
            while !stop.load(Ordering::Acquire) || host.in_flight() > 0 {
                host.poll(64, &mut pending);
                pending.shuffle(&mut rng);
                let n = rng.random_range(0..=pending.len());
                for r in pending.drain(..n) {
                    serve(&mut host, &r);
                }
                thread::yield_now();
            }
            host
        })
    };
    let warps: Vec<_> = (0..4u64)
        .map(|w| {
            let dev = dev.clone();
            thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(100 + w);
                for _ in 0..300 {
                    let reqs: Vec<WarpRequest> = (0..4)
                        .map(|_| WarpRequest {
                            ns: 0,
                            lba: rng.random_range(0..100_000),
                            nblocks: rng.random_range(1..=8),
                            dst: 0,
                        })
                        .collect();
                    let tickets = dev.submit_warp(&reqs);
                    for (t, r) in tickets.into_iter().zip(&reqs) {
                        let mut buf = vec![0; (r.nblocks * 512) as usize];
                        assert_eq!(dev.wait(t, LONG, &mut buf), 0);
                        assert_eq!(buf, expect(0, r.lba, r.nblocks));
                    }
                }
            })
        })
        .collect();
    for w in warps {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    let host = server.join().unwrap();
    assert_eq!(host.stats().completed, 4 * 300 * 4);
    assert_eq!(dev.tickets(), 4 * 300 * 4);
}

#[test]
fn bad_requests_get_an_error_status_and_the_ring_goes_on() {
    let (mut host, dev) = ring(4, 8192, DataMode::Pull);
    let mut buf = vec![0; 8192];
    type Submit<'a> = Box<dyn Fn() -> gpu_ring::standin::Ticket + 'a>;
    let cases: [(&str, Submit<'_>, u16); 8] = [
        (
            "unbound namespace",
            Box::new(|| dev.submit(2, 0, 1, 0)),
            status::INVALID_NAMESPACE,
        ),
        (
            "namespace 7",
            Box::new(|| dev.submit(7, 0, 1, 0)),
            status::INVALID_NAMESPACE,
        ),
        (
            "past the end",
            Box::new(|| dev.submit(1, 63, 2, 0)),
            status::LBA_OUT_OF_RANGE,
        ),
        (
            "lba overflow",
            Box::new(|| dev.submit(0, (1 << 48) - 1, 2, 0)),
            status::LBA_OUT_OF_RANGE,
        ),
        (
            "larger than a slot",
            Box::new(|| dev.submit(1, 0, 3, 0)),
            status::INVALID_FIELD,
        ),
        (
            "zero blocks",
            Box::new(|| dev.submit(0, 0, 0, 0)),
            status::INVALID_FIELD,
        ),
        (
            "flags",
            Box::new(|| dev.submit_words(1 << 33, 0)),
            status::INVALID_FIELD,
        ),
        (
            "reserved bits",
            Box::new(|| dev.submit_words(0x8000, 0)),
            status::INVALID_FIELD,
        ),
    ];
    for (what, submit, want) in &cases {
        for _ in 0..3 {
            let t = submit();
            let reads = poll_all(&mut host);
            assert!(reads.is_empty(), "{what}: {reads:?}");
            assert!(dev.test(&t), "{what}");
            assert_eq!(dev.wait(t, LONG, &mut buf), *want, "{what}");
        }
    }
    assert_eq!(host.stats().invalid, 3 * cases.len() as u64);
    assert_eq!(host.in_flight(), 0);
    // Random words with the right lap never panic and always get an answer.
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..2000 {
        let t = dev.submit_words(rng.random(), rng.random());
        for r in poll_all(&mut host) {
            assert!(r.bytes <= 8192 && r.nblocks >= 1);
            serve(&mut host, &r);
        }
        let st = dev.wait(t, LONG, &mut buf);
        assert!(
            [
                0,
                status::INVALID_NAMESPACE,
                status::INVALID_FIELD,
                status::LBA_OUT_OF_RANGE
            ]
            .contains(&st),
            "{st:#x}"
        );
    }
    // A valid read still works afterwards.
    let t = dev.submit(0, 5, 16, 0);
    let reads = poll_all(&mut host);
    assert_eq!(reads.len(), 1);
    serve(&mut host, &reads[0]);
    assert_eq!(dev.wait(t, LONG, &mut buf), status::SUCCESS);
    assert_eq!(buf, expect(0, 5, 16));
}

#[test]
fn a_timed_out_slot_is_released_by_its_next_occupant() {
    let (mut host, dev) = ring(2, 512, DataMode::Pull);
    let mut buf = [0u8; 512];
    let a = dev.submit(0, 100, 1, 0);
    let ra = poll_all(&mut host);
    assert_eq!(ra.len(), 1);
    // The host is slow: the waiter gives up.
    assert_eq!(
        dev.wait(a, Duration::from_millis(20), &mut buf),
        status::TIMEOUT
    );
    // The other slot keeps working.
    let b = dev.submit(0, 200, 1, 0);
    let rb = poll_all(&mut host);
    serve(&mut host, &rb[0]);
    assert_eq!(dev.wait(b, LONG, &mut buf), 0);
    // The next occupant of slot 0 waits for the late completion before writing its request.
    let dev2 = dev.clone();
    let c = thread::spawn(move || {
        let t = dev2.submit(0, 300, 1, 0);
        let mut buf = [0u8; 512];
        let st = dev2.wait(t, LONG, &mut buf);
        (st, buf)
    });
    thread::sleep(Duration::from_millis(30));
    assert!(
        poll_all(&mut host).is_empty(),
        "slot 0 is still the late read's"
    );
    assert_eq!(dev.tickets(), 3);
    // The late completion arrives; its data must not reach the next occupant.
    serve(&mut host, &ra[0]);
    let rc = loop {
        let r = poll_all(&mut host);
        if !r.is_empty() {
            break r;
        }
        thread::yield_now();
    };
    assert_eq!(rc[0].lba, 300);
    serve(&mut host, &rc[0]);
    let (st, got) = c.join().unwrap();
    assert_eq!(st, 0);
    assert_eq!(got[..], expect(0, 300, 1)[..]);
}

#[test]
fn a_ring_abandoned_mid_flight_answers_closed() {
    let (mut host, dev) = ring(2, 512, DataMode::Pull);
    let mut buf = [0u8; 512];
    let a = dev.submit(0, 1, 1, 0);
    let ra = poll_all(&mut host);
    let lent = host.lend(ra[0].slot);
    assert_eq!(lent.len(), 512);
    host.complete(ra[0].slot, 0);
    drop(host);
    // A waiter whose request the host took but never finished (its buffer still lent out).
    assert!(!dev.test(&a));
    assert_eq!(dev.wait(a, LONG, &mut buf), status::CLOSED);
    // A request written after the close, into a free slot: nobody serves it.
    let b = dev.submit(0, 2, 1, 0);
    assert!(!b.is_closed());
    assert_eq!(dev.wait(b, LONG, &mut buf), status::CLOSED);
    // The lent buffer goes back after the close: its completion is still published.
    drop(lent);
    // Slot 0 again: its occupant abandoned it, the completion arrived, so it is released.
    let c = dev.submit(0, 3, 1, 0);
    assert!(!c.is_closed());
    assert_eq!(dev.wait(c, LONG, &mut buf), status::CLOSED);
    // Slot 1: abandoned, never completed: a submitter gives up instead of waiting forever.
    let d = dev.submit(0, 4, 1, 0);
    assert!(d.is_closed());
    assert_eq!(dev.wait(d, LONG, &mut buf), status::CLOSED);
}

#[test]
fn a_lent_slot_publishes_its_completion_when_returned() {
    let (mut host, dev) = ring(4, 4096, DataMode::Pull);
    let t = dev.submit(0, 77, 8, 0);
    let r = poll_all(&mut host).pop().unwrap();
    let mut lent = host.lend(r.slot);
    assert!(host.data_mut(r.slot).is_empty(), "lent out");
    assert!(host.lend(r.slot).is_empty(), "lent once");
    let receiver = thread::spawn(move || {
        pattern(1, 512, 77, &mut lent.as_mut()[..4096]);
        lent
    });
    let lent = receiver.join().unwrap();
    host.complete(r.slot, 0);
    assert_eq!(host.in_flight(), 0);
    assert!(!dev.test(&t), "published only when the buffer is back");
    drop(lent);
    assert!(dev.test(&t));
    let mut buf = vec![0; 4096];
    assert_eq!(dev.wait(t, LONG, &mut buf), 0);
    assert_eq!(buf, expect(0, 77, 8));
    // Completing or lending a slot that is not taken does nothing.
    host.complete(r.slot, 0);
    host.complete(99, 0);
    assert!(host.lend(r.slot).is_empty());
    assert!(host.data_mut(99).is_empty());
    assert_eq!(host.stats().stray_completions, 2);
}

#[test]
fn stray_words_are_not_requests() {
    let (mut host, dev) = ring(4, 512, DataMode::Pull);
    // Wrong lap, mixed laps, zero: none is the request of ticket 0.
    dev.scribble(0, 2 << 48, 2 << 48);
    assert!(poll_all(&mut host).is_empty());
    dev.scribble(0, 1 << 48, 2 << 48 | 5);
    assert!(poll_all(&mut host).is_empty());
    dev.scribble(0, 0, 0);
    assert!(poll_all(&mut host).is_empty());
    let mut buf = [0u8; 512];
    let t = dev.submit(0, 9, 1, 0);
    let r = poll_all(&mut host);
    assert_eq!(r.len(), 1);
    serve(&mut host, &r[0]);
    assert_eq!(dev.wait(t, LONG, &mut buf), 0);
    assert_eq!(buf[..], expect(0, 9, 1)[..]);
    assert_eq!(host.stats().taken, 1);
}

#[test]
fn push_mode_hands_data_to_the_push_step() {
    let (mut host, dev) = ring(4, 8192, DataMode::Push);
    let mut dsts = vec![Vec::new(); 12];
    for round in 0..3u64 {
        let tickets: Vec<_> = (0..4u64)
            .map(|i| dev.submit(1, round * 4 + i, 2, round * 4 + i))
            .collect();
        let reads = poll_all(&mut host);
        assert_eq!(reads.len(), 4);
        let mut items = Vec::new();
        for r in reads.iter().rev() {
            pattern(r.nsid, 4096, r.lba, &mut host.data_mut(r.slot)[..r.bytes]);
            items.push(host.complete_push(r.slot, 0).unwrap());
        }
        assert!(host.complete_push(reads[0].slot, 0).is_none());
        assert!(tickets.iter().all(|t| !dev.test(t)), "not before the push");
        for item in &items {
            assert_eq!(item.bytes, 8192);
            assert_eq!(item.data_offset, u64::from(item.slot) * 8192);
            assert!(dev.push(item, |dst, bytes| dsts[dst as usize] = bytes.to_vec()));
        }
        for t in tickets {
            assert_eq!(dev.wait(t, LONG, &mut []), 0);
        }
    }
    for (i, d) in dsts.iter().enumerate() {
        assert_eq!(*d, expect(1, i as u64, 2), "destination {i}");
    }
    // Errors in push mode are completed directly.
    let t = dev.submit(1, 0, 1, 0);
    let r = poll_all(&mut host);
    host.complete(r[0].slot, status::LBA_OUT_OF_RANGE);
    assert_eq!(dev.wait(t, LONG, &mut []), status::LBA_OUT_OF_RANGE);
}

#[test]
fn lent_slots_filled_on_other_threads_complete_in_any_order() {
    use std::sync::mpsc;
    let (mut host, dev) = ring(8, 4096, DataMode::Pull);
    let (to_rx, rx_in) = mpsc::channel::<(gpu_ring::SlotData, Read, bool)>();
    let rx_in = Arc::new(std::sync::Mutex::new(rx_in));
    let (back_tx, back_rx) = mpsc::channel::<(gpu_ring::SlotData, Read, bool)>();
    // Two receiver threads fill lent slots, as commands receiving reads would.
    let receivers: Vec<_> = (0..2)
        .map(|_| {
            let rx_in = rx_in.clone();
            let back_tx = back_tx.clone();
            thread::spawn(move || {
                loop {
                    let job = rx_in.lock().unwrap().recv();
                    let Ok((mut lent, r, early)) = job else {
                        return;
                    };
                    pattern(r.nsid, 512, r.lba, &mut lent.as_mut()[..r.bytes]);
                    if early {
                        // Completed before the data arrived: publishing waits for this drop.
                        drop(lent);
                        continue;
                    }
                    back_tx.send((lent, r, early)).unwrap();
                }
            })
        })
        .collect();
    drop(back_tx);
    let warps: Vec<_> = (0..3u64)
        .map(|w| {
            let dev = dev.clone();
            thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(w);
                for _ in 0..400 {
                    let lba = rng.random_range(0..10_000);
                    let nblocks = rng.random_range(1..=8);
                    let mut buf = vec![0; (nblocks * 512) as usize];
                    assert_eq!(dev.read(0, lba, nblocks, &mut buf, LONG), 0);
                    assert_eq!(buf, expect(0, lba, nblocks));
                }
            })
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(99);
    let mut reads = Vec::new();
    let mut done = 0;
    let start = std::time::Instant::now();
    while done < 3 * 400 {
        assert!(start.elapsed() < LONG, "stalled after {done} completions");
        reads.clear();
        host.poll(64, &mut reads);
        for r in &reads {
            let early = rng.random_bool(0.5);
            let lent = host.lend(r.slot);
            if early {
                host.complete(r.slot, 0);
                done += 1;
            }
            to_rx.send((lent, *r, early)).unwrap();
        }
        while let Ok((lent, r, _)) = back_rx.try_recv() {
            // Return the buffer first or complete first, at random.
            if rng.random_bool(0.5) {
                drop(lent);
                host.complete(r.slot, 0);
            } else {
                host.complete(r.slot, 0);
                drop(lent);
            }
            done += 1;
        }
        thread::yield_now();
    }
    for w in warps {
        w.join().unwrap();
    }
    drop(to_rx);
    for r in receivers {
        r.join().unwrap();
    }
    assert_eq!(host.stats().completed, 1200);
    assert_eq!(host.in_flight(), 0);
}
