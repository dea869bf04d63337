#!/usr/bin/env bash
# The project's test command: installs what the tests need, then runs formatting and lint
# checks, every unit and integration test (the Linux kernel NVMe-oF host and target in a QEMU
# guest included), the Python package's tests, and brief fuzzing of the NVMe/TCP deframer and the authentication messages.
#
#   scripts/test.sh            everything (what CI runs)
#   scripts/test.sh --quick    skip the QEMU guest and fuzzing (no root needed)
#
# Needs root for apt-get on a fresh Debian/Ubuntu machine; run as root or with sudo available.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
[[ ${1:-} == --quick ]] && quick=1

stage() { printf '\n=== %s (%ss)\n' "$1" "$SECONDS"; }

sudo_() { if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi; }

# One build per run: incremental caches would only cost disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

stage "toolchain"
if ! command -v cargo >/dev/null; then
    echo "cargo not found: install Rust (https://rustup.rs) first" >&2
    exit 1
fi
cargo --version
rustup component list --installed 2>/dev/null | grep -qE '^(clippy|rustfmt)' || rustup component add clippy rustfmt 2>/dev/null || true

stage "build dependencies"
# OpenSSL 3 headers for nvmf-tls (NVMe/TCP TLS through the openssl crate); Debian's Python 3
# (3.11 or later) for the Python module, which workspace builds link against libpython.
if ! dpkg -s libssl-dev pkg-config python3-dev >/dev/null 2>&1; then
    if [[ $(id -u) != 0 ]] && ! command -v sudo >/dev/null; then
        echo "libssl-dev, pkg-config and python3-dev are needed to build (apt-get install libssl-dev pkg-config python3-dev)" >&2
        exit 1
    fi
    sudo_ apt-get update -qq
    sudo_ apt-get install -y -qq --no-install-recommends libssl-dev pkg-config python3-dev
fi
# PyO3 builds against the interpreter the Python stage tests with, not whichever is on PATH.
export PYO3_PYTHON="${PYO3_PYTHON:-/usr/bin/python3}"

stage "systemd units"
# Verifies deploy/ units (a warning fails the run) and prints their exposure scores. The units
# are checked from a copy whose ExecStart points at stand-ins, as the binaries are not
# installed here.
if ! command -v systemd-analyze >/dev/null; then
    if [[ $quick == 1 && $(id -u) != 0 ]] && ! command -v sudo >/dev/null; then
        echo "systemd-analyze not installed and no root to install it: unit checks skipped"
    else
        sudo_ apt-get update -qq
        sudo_ apt-get install -y -qq --no-install-recommends systemd
    fi
fi
if command -v systemd-analyze >/dev/null; then
    units=$(mktemp -d)
    trap 'rm -rf "$units"' EXIT
    cp -r deploy/*.service deploy/*.service.d "$units"/
    mkdir "$units/bin"
    for u in "$units"/*.service; do
        bin=$(basename "$u" .service)
        printf '#!/bin/sh\n' >"$units/bin/$bin" && chmod +x "$units/bin/$bin"
        sed -i "s|/usr/local/bin/|$units/bin/|" "$u"
    done
    verify=$(cd "$units" && systemd-analyze verify --man=no ./*.service 2>&1) || true
    if [[ -n $verify ]]; then
        printf 'systemd-analyze verify:\n%s\n' "$verify" >&2
        exit 1
    fi
    if [[ $(systemd-analyze --help) == *--offline* ]]; then
        for u in "$units"/*.service; do
            systemd-analyze security --offline=true --no-pager "$u" | tail -n 1
        done
    else
        echo "systemd-analyze $(systemd-analyze --version | head -n 1) has no --offline (systemd 252+): scores not printed"
    fi
fi

stage "prometheus"
# Debian's Prometheus server and promtool: the metrics test scrapes the target with them.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    if [[ $quick == 1 && $(id -u) != 0 ]] && ! command -v sudo >/dev/null; then
        echo "prometheus not installed and no root to install it: the metrics test skips"
    else
        sudo_ apt-get update -qq
        sudo_ apt-get install -y -qq --no-install-recommends prometheus
    fi
fi

stage "tgt"
# Debian's tgt (tgtd, tgtadm): the load generator's iscsi mode and its tests start it.
if ! command -v tgtd >/dev/null && [[ ! -x /usr/sbin/tgtd ]]; then
    if [[ $quick == 1 && $(id -u) != 0 ]] && ! command -v sudo >/dev/null; then
        echo "tgt not installed and no root to install it: the iscsi tests skip"
    else
        sudo_ apt-get update -qq
        sudo_ apt-get install -y -qq --no-install-recommends tgt
    fi
fi

stage "Kubernetes tools"
# kubernetes-validate (PyPI; it ships the Kubernetes JSON schemas, so the manifests under
# deploy/kubernetes/ are checked offline), in a venv of Debian's Python. csi-sanity (the CSI
# conformance suite) is a Go module: the csi test runs it when $CSI_SANITY names a build of it
# (the Go module proxy is not among the registries this test command relies on) and skips it,
# saying so, otherwise.
k8s_venv=target/k8s-venv
if [[ ! -x $k8s_venv/bin/kubernetes-validate ]]; then
    if ! dpkg -s python3-venv >/dev/null 2>&1; then
        sudo_ apt-get update -qq
        sudo_ apt-get install -y -qq --no-install-recommends python3-venv
    fi
    rm -rf "$k8s_venv"
    { /usr/bin/python3 -m venv "$k8s_venv" && "$k8s_venv/bin/python" -m pip install --quiet kubernetes-validate; } ||
        echo "kubernetes-validate could not be installed: the manifest schema check skips"
fi
[[ -x $k8s_venv/bin/kubernetes-validate ]] && export KUBERNETES_VALIDATE="$PWD/$k8s_venv/bin/kubernetes-validate"

stage "format and lints"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
# Every public item documented, every doc link resolving.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

if [[ $quick == 0 ]]; then
    stage "QEMU guest with the Linux kernel NVMe-oF host and target"
    sudo_ tests/interop/setup.sh --with-k612 --with-rocksdb --with-avahi
    # rdma-core headers: nvmf-rdma's layout test checks its declarations against them.
    dpkg -s libibverbs-dev librdmacm-dev >/dev/null 2>&1 || sudo_ apt-get install -y --no-install-recommends libibverbs-dev librdmacm-dev
    export NVMEOF_INTEROP=1
fi

stage "build"
cargo build --workspace --bins --locked

stage "tests"
# Interop tests boot guests: run test binaries one at a time so guests do not compete for the CPUs.
cargo test --workspace --locked -- --test-threads="${TEST_THREADS:-2}"

stage "Python package"
python/tests/run.sh

if [[ $quick == 0 ]]; then
    stage "fuzzing: NVMe/TCP deframers, then the target's capsule handling"
    # cargo-fuzz is probed as a binary, never by running `cargo fuzz`: where it is missing that
    # run leaves the `cargo install` after it unable to query rustc.
    cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
    case ":$PATH:" in *":$cargo_bin:"*) ;; *) export PATH="$PATH:$cargo_bin" ;; esac
    if ! command -v cargo-fuzz >/dev/null; then
        cargo install cargo-fuzz --locked
    fi
    crates/nvmf-tcp/fuzz/run-brief.sh "${FUZZ_SECONDS:-20}"
    (cd target-daemon/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run capsule -- \
        -max_total_time="${FUZZ_SECONDS:-20}" -max_len=8192 -print_final_stats=1)
    stage "fuzzing: control request lines and the change plan"
    (cd target-daemon/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run control -- \
        -max_total_time="${FUZZ_SECONDS:-20}" -max_len=4096 -print_final_stats=1)
    stage "fuzzing: authentication messages and the DH-HMAC-CHAP state machines"
    NVME_AUTH_FUZZ_SEED_DIR="$PWD/crates/nvme-auth/fuzz/corpus" \
        cargo test --quiet --locked -p nvme-auth --test fuzz_inputs seeds_run
    for t in auth_message auth_controller auth_host; do
        (cd crates/nvme-auth/fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run "$t" "corpus/$t" -- \
            -max_total_time="${FUZZ_SECONDS:-20}" -max_len=4096 -print_final_stats=1)
    done
fi

stage "done"
