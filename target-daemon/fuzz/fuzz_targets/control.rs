//! Arbitrary control request lines (the control socket's and the remote control API's) through
//! the request parser and the change plan: decoded, mapped to their change, applied to a
//! configuration, validated, and planned back from the configuration they came from. Any
//! panic is a bug; a refusal is an answer.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use nvmeof_target::config::Config;
use nvmeof_target::control::{change_for, decode};
use nvmeof_target::plan::plan;

const CONFIG: &str = r#"
[[listener]]
address = "tcp://127.0.0.1:4420"

[[subsystem]]
nqn = "nqn.2026-11.io.nvmeof-direct:fuzz"
allow_any_host = false
hosts = ["nqn.2014-08.org.nvmexpress:uuid:fuzz"]

[[subsystem.namespace]]
backend = "mem:4M"
"#;

fn config() -> &'static Config {
    static C: OnceLock<Config> = OnceLock::new();
    C.get_or_init(|| Config::from_toml(CONFIG).unwrap().with_explicit_nsids())
}

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(req) = decode(line) else { return };
    let cfg = config();
    let Ok(Some(change)) = change_for(&req, cfg) else {
        return;
    };
    let _ = change.in_effect(cfg);
    let mut new = cfg.clone();
    if change.apply(&mut new).is_err() || new.validate().is_err() {
        return;
    }
    let _ = plan(cfg, &new);
});
