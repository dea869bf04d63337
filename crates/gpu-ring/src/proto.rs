//! The ring protocol: laps, the layout of request and completion words, request validation and
//! the status values a waiter can get.
//!
//! Every word the device writes for the host (the two request words) and every word the host
//! writes for the device (the completion word) carries the *lap* of the ticket it belongs to in
//! its top 16 bits. A reader takes a word only when its lap is the one it expects, so zeroed
//! memory, a stale word of an earlier occupant and a half-written 16-byte request are never
//! mistaken for new ones, and no fence per request is needed between the two sides.
//!
//! `cuda-kernels/include/nvmf_gpu.cuh` implements the same encoding on the device; change both
//! together.

use nvme_spec::status::{generic, sct};

/// Bit position of the lap in every ring word.
pub const LAP_SHIFT: u32 = 48;
/// Number of distinct laps (1..=65535; 0 never occurs, so zeroed memory is never a word).
pub const LAPS: u64 = 65535;
/// Largest LBA a request word can carry, plus one.
pub const LBA_LIMIT: u64 = 1 << LAP_SHIFT;
/// Most blocks one request may read (the field holds `nblocks - 1` in 16 bits).
pub const MAX_BLOCKS: u32 = 1 << 16;
/// Size of the namespace table of a ring (the `ns` field indexes it).
pub const MAX_NAMESPACES: usize = 8;
/// Request flag the device sets when the arguments it was given cannot be encoded (zero or
/// too many blocks, an LBA of 2^48 or more, a namespace index above 255). The host answers such
/// a request with Invalid Field, as any request with non-zero flags.
pub const FLAG_BAD_ARGS: u8 = 0x01;

/// Bytes of one request (two words) in the request array.
pub const REQUEST_BYTES: usize = 16;
/// Bytes of one completion word in the completion array.
pub const COMPLETION_BYTES: usize = 8;

/// One request as it lies in the request array: `w0` then `w1`, little-endian.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestWords {
    /// `lap << 48 | ns << 40 | flags << 32 | (nblocks - 1) << 16` (bits 0..16 are zero).
    pub w0: u64,
    /// `lap << 48 | lba`.
    pub w1: u64,
}
const _: () = assert!(std::mem::size_of::<RequestWords>() == REQUEST_BYTES);
const _: () = assert!(std::mem::align_of::<RequestWords>() == 8);

/// NVMe status values (the status field `SCT << 8 | SC`) a ring completion can carry, and the
/// two values only the device side produces.
pub mod status {
    use super::{generic, sct};

    const fn generic_status(sc: u8) -> u16 {
        ((sct::GENERIC as u16) << 8) | sc as u16
    }

    /// Successful completion.
    pub const SUCCESS: u16 = 0;
    /// Invalid Field in Command: non-zero flags or reserved bits, or more bytes than a slot
    /// holds.
    pub const INVALID_FIELD: u16 = generic_status(generic::INVALID_FIELD);
    /// Invalid Namespace or Format: the namespace index is not bound to the ring.
    pub const INVALID_NAMESPACE: u16 = generic_status(generic::INVALID_NAMESPACE);
    /// LBA Out of Range: `lba + nblocks` is past the end of the namespace.
    pub const LBA_OUT_OF_RANGE: u16 = generic_status(generic::LBA_OUT_OF_RANGE);
    /// Device side only: the waiter's deadline passed before the completion arrived
    /// (`NVMF_GPU_TIMEOUT`). Never written by the host.
    pub const TIMEOUT: u16 = 0xFFFF;
    /// Device side only: the host closed the ring (`NVMF_GPU_CLOSED`); the request was not
    /// or will not be served. Never written by the host.
    pub const CLOSED: u16 = 0xFFFE;
}

/// The lap of ticket `ticket` in a ring of `slots` slots: `(ticket / slots) % 65535 + 1`.
pub const fn lap(ticket: u64, slots: u32) -> u16 {
    ((ticket / slots as u64) % LAPS + 1) as u16
}

/// The lap before `lap` (`prev_lap(1) == 65535`).
pub const fn prev_lap(lap: u16) -> u16 {
    if lap <= 1 { LAPS as u16 } else { lap - 1 }
}

/// The lap after `lap` (`next_lap(65535) == 1`).
pub const fn next_lap(lap: u16) -> u16 {
    if lap as u64 >= LAPS { 1 } else { lap + 1 }
}

/// The lap carried by a ring word.
pub const fn word_lap(word: u64) -> u16 {
    (word >> LAP_SHIFT) as u16
}

/// A request's fields as the device encodes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Index into the ring's namespace table.
    pub ns: u8,
    /// Must be 0 ([`FLAG_BAD_ARGS`] marks arguments the device could not encode).
    pub flags: u8,
    /// Blocks to read, 1..=65536.
    pub nblocks: u32,
    /// First block, below 2^48.
    pub lba: u64,
}

impl Request {
    /// The request the device writes for `submit(ns, lba, nblocks)`: the fields as given when
    /// they fit, otherwise namespace 0, one block at LBA 0 with [`FLAG_BAD_ARGS`] set, so the
    /// host answers it with Invalid Field (never a read of some other, truncated address).
    pub const fn from_args(ns: u32, lba: u64, nblocks: u32) -> Request {
        if ns > 0xFF || lba >= LBA_LIMIT || nblocks == 0 || nblocks > MAX_BLOCKS {
            Request {
                ns: 0,
                flags: FLAG_BAD_ARGS,
                nblocks: 1,
                lba: 0,
            }
        } else {
            Request {
                ns: ns as u8,
                flags: 0,
                nblocks,
                lba,
            }
        }
    }

    /// The two words of this request for lap `lap`. Fields out of range are masked to their
    /// width (build requests with [`Request::from_args`] to avoid that).
    pub const fn encode(&self, lap: u16) -> RequestWords {
        let l = (lap as u64) << LAP_SHIFT;
        RequestWords {
            w0: l
                | (self.ns as u64) << 40
                | (self.flags as u64) << 32
                | ((self.nblocks.wrapping_sub(1) & 0xFFFF) as u64) << 16,
            w1: l | (self.lba & (LBA_LIMIT - 1)),
        }
    }
}

/// Decoded request words: the laps of both words, the fields and the reserved low bits of `w0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodedRequest {
    /// Lap of `w0`.
    pub lap0: u16,
    /// Lap of `w1`.
    pub lap1: u16,
    /// The fields.
    pub request: Request,
    /// Bits 0..16 of `w0`, which must be zero.
    pub reserved: u16,
}

/// Splits request words into laps and fields.
pub const fn decode_request(words: RequestWords) -> DecodedRequest {
    DecodedRequest {
        lap0: word_lap(words.w0),
        lap1: word_lap(words.w1),
        request: Request {
            ns: (words.w0 >> 40) as u8,
            flags: (words.w0 >> 32) as u8,
            nblocks: ((words.w0 >> 16) & 0xFFFF) as u32 + 1,
            lba: words.w1 & (LBA_LIMIT - 1),
        },
        reserved: words.w0 as u16,
    }
}

/// The completion word of lap `lap` with NVMe status `status`: `lap << 48 | status << 32`.
pub const fn encode_completion(lap: u16, status: u16) -> u64 {
    (lap as u64) << LAP_SHIFT | (status as u64) << 32
}

/// The lap and status of a completion word.
pub const fn decode_completion(word: u64) -> (u16, u16) {
    (word_lap(word), (word >> 32) as u16)
}

/// A namespace a ring may read: its table index is the `ns` field of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NsBinding {
    /// NVMe namespace ID on the controller.
    pub nsid: u32,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Namespace size in blocks.
    pub blocks: u64,
}

/// A validated request, ready to be started as a read into its slot's data area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Read {
    /// The ring slot (its data area receives the bytes; complete it with this number).
    pub slot: u32,
    /// Namespace ID on the controller.
    pub nsid: u32,
    /// First block.
    pub lba: u64,
    /// Blocks to read, 1..=65536.
    pub nblocks: u32,
    /// `nblocks * block_size`, at most the slot size.
    pub bytes: usize,
}

/// Checks a request taken from slot `slot` against the ring's namespace table and slot size.
/// Returns the read to start, or the NVMe status to complete the request with.
pub fn validate(
    decoded: &DecodedRequest,
    slot: u32,
    namespaces: &[NsBinding],
    slot_bytes: u32,
) -> Result<Read, u16> {
    let r = &decoded.request;
    let ns = namespaces
        .get(usize::from(r.ns))
        .ok_or(status::INVALID_NAMESPACE)?;
    if r.flags != 0 || decoded.reserved != 0 {
        return Err(status::INVALID_FIELD);
    }
    let bytes = u64::from(r.nblocks) * u64::from(ns.block_size);
    if bytes > u64::from(slot_bytes) {
        return Err(status::INVALID_FIELD);
    }
    match r.lba.checked_add(u64::from(r.nblocks)) {
        Some(end) if end <= ns.blocks => {}
        _ => return Err(status::LBA_OUT_OF_RANGE),
    }
    Ok(Read {
        slot,
        nsid: ns.nsid,
        lba: r.lba,
        nblocks: r.nblocks,
        bytes: bytes as usize,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NS: [NsBinding; 2] = [
        NsBinding {
            nsid: 1,
            block_size: 512,
            blocks: 1000,
        },
        NsBinding {
            nsid: 7,
            block_size: 4096,
            blocks: 10,
        },
    ];

    fn check(ns: u8, lba: u64, nblocks: u32) -> Result<Read, u16> {
        let words = Request::from_args(u32::from(ns), lba, nblocks).encode(3);
        validate(&decode_request(words), 5, &NS, 8192)
    }

    #[test]
    fn statuses_are_the_nvme_values() {
        assert_eq!(status::INVALID_FIELD, 0x0002);
        assert_eq!(status::INVALID_NAMESPACE, 0x000B);
        assert_eq!(status::LBA_OUT_OF_RANGE, 0x0080);
    }

    #[test]
    fn validation_answers_each_bad_request() {
        assert_eq!(
            check(0, 10, 16),
            Ok(Read {
                slot: 5,
                nsid: 1,
                lba: 10,
                nblocks: 16,
                bytes: 8192
            })
        );
        assert_eq!(check(1, 9, 1).unwrap().nsid, 7);
        assert_eq!(check(2, 0, 1), Err(status::INVALID_NAMESPACE));
        assert_eq!(check(7, 0, 1), Err(status::INVALID_NAMESPACE));
        assert_eq!(check(0, 990, 11), Err(status::LBA_OUT_OF_RANGE));
        assert_eq!(check(0, 1000, 1), Err(status::LBA_OUT_OF_RANGE));
        assert_eq!(check(0, LBA_LIMIT - 1, 1), Err(status::LBA_OUT_OF_RANGE));
        assert_eq!(check(0, 0, 17), Err(status::INVALID_FIELD));
        assert_eq!(check(1, 0, 3), Err(status::INVALID_FIELD));
        // Arguments that cannot be encoded become an Invalid Field request.
        assert_eq!(check(0, 0, 0), Err(status::INVALID_FIELD));
        assert_eq!(check(0, LBA_LIMIT, 1), Err(status::INVALID_FIELD));
        assert_eq!(
            validate(
                &decode_request(Request::from_args(300, 0, 1).encode(1)),
                0,
                &NS,
                8192
            ),
            Err(status::INVALID_FIELD)
        );
        // Reserved bits and flags.
        let mut words = Request::from_args(0, 0, 1).encode(1);
        words.w0 |= 1;
        assert_eq!(
            validate(&decode_request(words), 0, &NS, 8192),
            Err(status::INVALID_FIELD)
        );
        let mut words = Request::from_args(0, 0, 1).encode(1);
        words.w0 |= 0x80 << 32;
        assert_eq!(
            validate(&decode_request(words), 0, &NS, 8192),
            Err(status::INVALID_FIELD)
        );
    }

    #[test]
    fn lap_sequence_over_a_full_cycle() {
        // Every slot sees laps 1, 2, ..., 65535, 1, ...: consecutive occupants of a slot always
        // differ by one lap, and no lap is 0.
        for slots in [2u32, 4, 32, 4096] {
            let mut expected = 1u16;
            for round in 0..(LAPS + 3) {
                let t = round * u64::from(slots) + u64::from(slots) - 1;
                let l = lap(t, slots);
                assert_eq!(l, expected, "slots {slots} round {round}");
                assert_eq!(lap(t + 1 - u64::from(slots), slots), l);
                assert_ne!(l, 0);
                expected = next_lap(expected);
            }
        }
        assert_eq!(prev_lap(1), 65535);
        assert_eq!(next_lap(65535), 1);
    }

    proptest! {
        #[test]
        fn request_words_round_trip(
            lap_v in 1u16..=65535,
            ns in 0u8..=255,
            nblocks in 1u32..=MAX_BLOCKS,
            lba in 0u64..LBA_LIMIT,
        ) {
            let r = Request { ns, flags: 0, nblocks, lba };
            let d = decode_request(r.encode(lap_v));
            prop_assert_eq!(d.lap0, lap_v);
            prop_assert_eq!(d.lap1, lap_v);
            prop_assert_eq!(d.request, r);
            prop_assert_eq!(d.reserved, 0);
            prop_assert_eq!(Request::from_args(u32::from(ns), lba, nblocks), r);
        }

        #[test]
        fn completion_words_round_trip(lap_v in 1u16..=65535, st in any::<u16>()) {
            let w = encode_completion(lap_v, st);
            prop_assert_eq!(decode_completion(w), (lap_v, st));
            prop_assert_eq!(w as u32, 0);
            prop_assert_ne!(w, 0);
        }

        #[test]
        fn laps_of_neighbouring_occupants(slots_log in 1u32..=12, t in any::<u64>()) {
            let slots = 1u32 << slots_log;
            let n = u64::from(slots);
            let l = lap(t, slots);
            prop_assert!(l >= 1);
            // Every ticket of the same lap window shares the lap.
            prop_assert_eq!(lap(t - t % n, slots), l);
            if let Some(next) = t.checked_add(n) {
                // The next occupant of the slot has the next lap, and waits for this one.
                prop_assert_eq!(lap(next, slots), next_lap(l));
                prop_assert_eq!(prev_lap(lap(next, slots)), l);
                prop_assert_ne!(lap(next, slots), l);
            }
        }

        #[test]
        fn a_torn_request_is_never_taken(
            old_lap in 1u16..=65535,
            nblocks in 1u32..=MAX_BLOCKS,
            lba in 0u64..LBA_LIMIT,
        ) {
            // Half of a new request over half of the previous occupant's: the laps differ.
            let new_lap = next_lap(old_lap);
            let r = Request { ns: 0, flags: 0, nblocks, lba };
            let old = r.encode(old_lap);
            let new = r.encode(new_lap);
            let torn1 = decode_request(RequestWords { w0: new.w0, w1: old.w1 });
            let torn2 = decode_request(RequestWords { w0: old.w0, w1: new.w1 });
            prop_assert!(torn1.lap0 != torn1.lap1);
            prop_assert!(torn2.lap0 != torn2.lap1);
        }
    }
}
