#!/usr/bin/env bash
# The Python package's tests on a machine with an NVIDIA GPU, where PyTorch (CUDA) and CuPy are
# installed but neither Rust nor a network is: test_gpu.py reads into CUDA tensors and CuPy
# arrays; the other test files run too.
#
#   python/tests/run-gpu.sh --prepare DIR   here: build the wheel and the release binaries,
#                                           copy them into DIR (carry DIR and python/tests/)
#   python/tests/run-gpu.sh --from DIR      there: unpack the wheel, run pytest with the
#                                           interpreter that has torch and CuPy ($PYTHON,
#                                           default python3)
#
# The wheel is abi3 for CPython >= 3.11; it is unpacked into DIR/site and put on PYTHONPATH, so
# neither pip nor venv is needed there.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

case "${1:-}" in
--prepare)
    dir="$(mkdir -p "${2:?--prepare needs a directory}" && cd "$2" && pwd)"
    cd "$root"
    export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" PYO3_PYTHON="${PYO3_PYTHON:-/usr/bin/python3}"
    cargo build --release --locked -p nvmeof-target -p nvmeof-initiator --bins
    venv=target/python-venv
    if [[ ! -x $venv/bin/maturin ]]; then
        rm -rf "$venv"
        /usr/bin/python3 -m venv --system-site-packages "$venv"
        "$venv/bin/python" -m pip install -q 'maturin>=1.5,<2'
    fi
    rm -f "$dir"/nvmeof-*.whl
    (cd python && "../$venv/bin/maturin" build --release --locked -i /usr/bin/python3 --auditwheel skip -o "$dir")
    cp target/release/nvmeof-targetd target/release/nvmeof-initd target/release/nvmeof "$dir"/
    echo "prepared $dir: $(cd "$dir" && echo *)"
    ;;
--from)
    dir="$(cd "${2:?--from needs a directory}" && pwd)"
    py="${PYTHON:-python3}"
    rm -rf "$dir/site"
    "$py" -m zipfile -e "$dir"/nvmeof-*.whl "$dir/site"
    export PYTHONPATH="$dir/site${PYTHONPATH:+:$PYTHONPATH}" NVMEOF_TARGETD="$dir/nvmeof-targetd"
    cd "$here"
    PYTHONDONTWRITEBYTECODE=1 "$py" -m pytest -v -p no:cacheprovider -rs \
        test_gpu.py test_nvmeof.py test_torch.py
    ;;
*)
    sed -n '2,14p' "$0"
    exit 2
    ;;
esac
