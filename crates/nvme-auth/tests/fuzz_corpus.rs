//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) and a fixed set of pseudo-random inputs
//! through the fuzz targets' harness (`fuzz/harness.rs`), so that CI checks without a nightly
//! toolchain what `cargo fuzz` explores: no panic, Failure1/Failure2 on every failure found.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[path = "../../../fuzz/harness.rs"]
mod harness;

fn corpus(target: &str, run: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let data = std::fs::read(entry.unwrap().path()).unwrap();
        run(&data);
        n += 1;
    }
    n
}

/// Inputs made of step bytes (small values, so most are meaningful steps) and any bytes.
fn random_inputs(seed: u64, count: usize, run: fn(&[u8])) {
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..count {
        let len = rng.random_range(0..48);
        let data: Vec<u8> = (0..len)
            .map(|_| {
                if rng.random_bool(0.7) {
                    rng.random_range(0..8)
                } else {
                    rng.random()
                }
            })
            .collect();
        run(&data);
    }
}

#[test]
fn corpus_and_random_inputs_never_panic() {
    for (target, run) in [
        ("auth_message", harness::message as fn(&[u8])),
        ("auth_controller", harness::controller),
        ("auth_host", harness::host),
    ] {
        assert!(corpus(target, run) > 0, "empty corpus for {target}");
        random_inputs(0x5eed, 400, run);
    }
}
