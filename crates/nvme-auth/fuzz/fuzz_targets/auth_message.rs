//! Arbitrary bytes as an authentication message: parse, and encode/parse round trip.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nvme_auth::fuzzing::message(data));
