//! The fuzz targets' drivers (`nvme_auth::fuzzing`) on their seed inputs and on a fixed set of
//! pseudo-random ones, so that CI checks on stable what `cargo fuzz` explores: no panic, and
//! Failure1/Failure2 for every failure found. With `NVME_AUTH_FUZZ_SEED_DIR` set, the seeds
//! are also written there as `<target>/<name>` (the start of a corpus).

use nvme_auth::fuzzing;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn run(target: &str, data: &[u8]) {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    match target {
        "auth_message" => fuzzing::message(data),
        "auth_controller" => fuzzing::controller(data, &mut rng),
        "auth_host" => fuzzing::host(data, &mut rng),
        other => panic!("unknown fuzz target {other}"),
    }
}

#[test]
fn seeds_run_and_are_written_where_asked() {
    let seeds = fuzzing::seed_inputs();
    for (target, _, data) in &seeds {
        run(target, data);
    }
    if let Some(dir) = std::env::var_os("NVME_AUTH_FUZZ_SEED_DIR") {
        let dir = std::path::PathBuf::from(dir);
        for (target, name, data) in &seeds {
            std::fs::create_dir_all(dir.join(target)).unwrap();
            std::fs::write(dir.join(target).join(name), data).unwrap();
        }
    }
}

#[test]
fn pseudo_random_inputs_never_panic() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for target in ["auth_message", "auth_controller", "auth_host"] {
        for _ in 0..400 {
            // Mostly small values (steps), some arbitrary bytes.
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
            run(target, &data);
        }
    }
}
