#!/usr/bin/env bash
# Runs every cargo-fuzz target of this directory for a short time.
#
#   crates/nvmf-tcp/fuzz/run-brief.sh [SECONDS]      (default 20 seconds per target)
#
# Installs cargo-fuzz when it is missing. There is no nightly toolchain here, so the stable
# toolchain is used with RUSTC_BOOTSTRAP=1 (cargo-fuzz needs -Z flags for the sanitizer and
# coverage instrumentation). Exits non-zero when a target crashes or fails to build; crash
# inputs are left in artifacts/<target>/, the corpus in corpus/<target>/.
set -euo pipefail

seconds="${1:-20}"
case "$seconds" in
    ''|*[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 2 ;;
esac

cd "$(dirname "$0")"

# Probe for the binary itself: running `cargo fuzz` where it is missing leaves cargo in a state
# where the `cargo install` that follows fails to query rustc.
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
if ! command -v cargo-fuzz >/dev/null 2>&1 && [ ! -x "$cargo_bin/cargo-fuzz" ]; then
    echo "installing cargo-fuzz" >&2
    cargo install cargo-fuzz --locked
fi
case ":$PATH:" in
    *":$cargo_bin:"*) ;;
    *) export PATH="$PATH:$cargo_bin" ;;
esac

# Seed the corpus with clean conversations (written by a test of the crate, which also
# checks that they run without a protocol error).
NVMF_TCP_FUZZ_SEED_DIR="$PWD/corpus" \
    cargo test --quiet --manifest-path ../Cargo.toml --test props fuzz_seeds_are_clean_conversations

export RUSTC_BOOTSTRAP=1

targets="$(cargo fuzz list)"
if [ -z "$targets" ]; then
    echo "no fuzz targets found" >&2
    exit 1
fi

status=0
for target in $targets; do
    mkdir -p "corpus/$target"
    echo "== fuzzing $target for ${seconds}s" >&2
    if ! cargo fuzz run "$target" "corpus/$target" -- \
        -max_total_time="$seconds" -max_len=4096 -print_final_stats=1; then
        echo "== $target FAILED (see artifacts/$target/)" >&2
        status=1
    fi
done
exit "$status"
