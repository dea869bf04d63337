#!/usr/bin/env bash
# Builds and runs the GPU tests of nvmeof-gpu, nvmeof-cuda-kernels (kernels; GPU request rings:
# GPU-issued reads served by a host thread) and nvmeof-initiator (reads into GPU memory over
# NVMe/TCP against the in-process target; GPU-issued reads through rings the queue tasks serve;
# dma-buf export and the RDMA registration request of GPU memory) on a machine with an NVIDIA GPU, then prints a pass/fail/skip table.
#
#   cuda-kernels/run-gpu-tests.sh                 cargo on PATH: build release test binaries, run them
#   cuda-kernels/run-gpu-tests.sh --bin-dir DIR   run prebuilt test binaries from DIR (no Rust needed)
#   cuda-kernels/run-gpu-tests.sh --prepare DIR   build here and copy the test binaries into DIR
#
# Without cargo and without --bin-dir, prebuilt binaries are looked for in .gpu-bin/ at the
# repository root. On a GPU machine a missing driver or NVRTC is a failure (NVMEOF_GPU_REQUIRE=1);
# pass --allow-skip to let such tests report SKIP instead (what CI without a GPU does).
# libnvrtc is searched in the usual CUDA toolkit places and added to LD_LIBRARY_PATH.
set -u -o pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
mode=auto
bin_dir=""
allow_skip=0
while [ $# -gt 0 ]; do
    case "$1" in
        --bin-dir) mode=prebuilt; bin_dir="${2:?--bin-dir needs a directory}"; shift 2 ;;
        --prepare) mode=prepare; bin_dir="${2:?--prepare needs a directory}"; shift 2 ;;
        --allow-skip) allow_skip=1; shift ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

# Builds the release test binaries and prints "<suite> <path>" per binary.
build_tests() {
    local json
    # Each --test applies to the packages that have such a test target.
    local targets=(--test gpu --test gpu_rdma --test gpu_ring)
    json="$(cd "$root" && cargo test --release -p nvmeof-gpu -p nvmeof-cuda-kernels -p nvmeof-initiator \
        "${targets[@]}" --no-run --message-format=json 2>/dev/null)" || {
        echo "cargo build of the GPU tests failed:" >&2
        (cd "$root" && cargo test --release -p nvmeof-gpu -p nvmeof-cuda-kernels -p nvmeof-initiator "${targets[@]}" --no-run) >&2
        return 1
    }
    printf '%s\n' "$json" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    name = m.get("target", {}).get("name")
    if m.get("reason") == "compiler-artifact" and m.get("executable") and name in ("gpu", "gpu_rdma", "gpu_ring"):
        pkg = m["package_id"]
        suite = ("nvmeof-cuda-kernels" if "cuda-kernels" in pkg
                 else "nvmeof-initiator" if "nvmeof-initiator" in pkg else "nvmeof-gpu")
        if name == "gpu_rdma":
            suite += "-rdma"
        elif name == "gpu_ring":
            suite += "-ring"
        print(suite, m["executable"])
'
}

if [ "$mode" = auto ]; then
    if command -v cargo >/dev/null 2>&1; then
        mode=cargo
    else
        mode=prebuilt
        bin_dir="$root/.gpu-bin"
    fi
fi

declare -a suites=() bins=()
case "$mode" in
    prepare|cargo)
        list="$(build_tests)" || exit 1
        while read -r suite path; do
            [ -n "$suite" ] || continue
            suites+=("$suite"); bins+=("$path")
        done <<< "$list"
        if [ "$mode" = prepare ]; then
            mkdir -p "$bin_dir"
            for i in "${!bins[@]}"; do
                cp "${bins[$i]}" "$bin_dir/${suites[$i]}-tests"
                echo "prepared $bin_dir/${suites[$i]}-tests"
            done
            exit 0
        fi
        ;;
    prebuilt)
        for f in "$bin_dir"/*-tests; do
            [ -x "$f" ] || continue
            suites+=("$(basename "$f" -tests)"); bins+=("$f")
        done
        ;;
esac
if [ "${#bins[@]}" -eq 0 ]; then
    echo "no GPU test binaries found (mode $mode${bin_dir:+, dir $bin_dir})" >&2
    exit 1
fi

# Make libnvrtc findable.
nvrtc_dir=""
for d in ${CUDA_HOME:+"$CUDA_HOME/lib64"} ${CUDA_PATH:+"$CUDA_PATH/lib64"} \
    /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 \
    /usr/local/cuda-*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then nvrtc_dir="$d"; break; fi
done
if [ -z "$nvrtc_dir" ] && command -v python3 >/dev/null 2>&1; then
    nvrtc_dir="$(python3 - <<'EOF' 2>/dev/null
import glob, site, sys
paths = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for p in paths:
    for lib in sorted(glob.glob(p + "/nvidia/cu1*/lib/libnvrtc.so*") + glob.glob(p + "/nvidia/cuda_nvrtc/lib/libnvrtc.so*")):
        print(lib.rsplit("/", 1)[0]); raise SystemExit
EOF
)"
fi
if [ -n "$nvrtc_dir" ]; then
    export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "libnvrtc: $nvrtc_dir"
else
    echo "libnvrtc: not found (kernel tests will fail or skip)"
fi
if [ "$allow_skip" -eq 0 ]; then export NVMEOF_GPU_REQUIRE=1; fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
rc_all=0
rows=()
for i in "${!bins[@]}"; do
    suite="${suites[$i]}"
    echo "===== $suite: ${bins[$i]}"
    : > "$log"
    "${bins[$i]}" --test-threads=1 --show-output 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || rc_all=1
    while read -r name result; do
        status=PASS
        [ "$result" = ok ] || status=FAIL
        if [ "$status" = PASS ] && grep -q "^SKIP $name:" "$log"; then status=SKIP; fi
        rows+=("$suite|$name|$status")
    done < <(sed -n 's/^test \([A-Za-z0-9_:]*\) \.\.\. \([A-Za-z]*\).*/\1 \2/p' "$log")
    if [ "$rc" -ne 0 ] && ! grep -q '^test .* \.\.\. FAILED' "$log"; then
        rows+=("$suite|(test binary)|FAIL")
    fi
done

pass=0; fail=0; skip=0
echo
printf '%-26s %-52s %s\n' SUITE TEST RESULT
printf '%-26s %-52s %s\n' -------------------------- ---------------------------------------------------- ------
for row in "${rows[@]}"; do
    IFS='|' read -r suite name status <<< "$row"
    printf '%-26s %-52s %s\n' "$suite" "$name" "$status"
    case "$status" in PASS) pass=$((pass + 1)) ;; FAIL) fail=$((fail + 1)) ;; SKIP) skip=$((skip + 1)) ;; esac
done
echo
echo "$pass passed, $fail failed, $skip skipped"
if [ "$fail" -ne 0 ] || [ "$rc_all" -ne 0 ]; then exit 1; fi
exit 0
