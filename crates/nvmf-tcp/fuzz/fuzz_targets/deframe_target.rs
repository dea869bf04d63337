//! Arbitrary bytes, split at arbitrary points, into the controller side of a connection.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = nvmf_tcp::fuzzing::drive_target(data);
});
