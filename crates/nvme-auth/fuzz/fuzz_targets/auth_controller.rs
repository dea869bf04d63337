//! The controller state machine driven by a script of genuine, raw, replayed and tampered
//! host messages.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rand::SeedableRng;

fuzz_target!(|data: &[u8]| {
    nvme_auth::fuzzing::controller(data, &mut rand::rngs::StdRng::seed_from_u64(0x5eed));
});
