//! The host state machine driven by a script of genuine, raw and replayed controller messages.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rand::SeedableRng;

fuzz_target!(|data: &[u8]| {
    nvme_auth::fuzzing::host(data, &mut rand::rngs::StdRng::seed_from_u64(0x5eed));
});
