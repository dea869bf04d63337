#!/usr/bin/env bash
# Builds the nvmeof wheel with maturin and installs it into a virtual environment, as a user
# would, then runs the pytest suite against target/debug/nvmeof-targetd (build it first:
# `cargo build --workspace --bins`). Debian's /usr/bin/python3 with python3-venv, python3-numpy,
# python3-pytest and python3-torch (installed here when missing); maturin from PyPI into the venv.
set -euo pipefail
cd "$(dirname "$0")/../.."

sudo_() { if [[ $(id -u) == 0 ]]; then "$@"; else sudo "$@"; fi; }

py=/usr/bin/python3
missing=()
for p in python3-venv python3-numpy python3-pytest; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
# PyTorch (CPU) for the nvmeof.torch tests: any torch the interpreter imports will do.
"$py" -c "import torch" >/dev/null 2>&1 || missing+=(python3-torch)
if ((${#missing[@]})); then
    sudo_ apt-get update -qq
    sudo_ apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

venv=target/python-venv
if [[ ! -x $venv/bin/maturin ]]; then
    rm -rf "$venv"
    "$py" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q 'maturin>=1.5,<2'
fi

rm -rf target/wheels
(cd python && "../$venv/bin/maturin" build --locked -i "$py" --auditwheel skip -o ../target/wheels)
"$venv/bin/python" -m pip install -q --force-reinstall --no-deps target/wheels/nvmeof-*.whl

export NVMEOF_TARGETD="$PWD/target/debug/nvmeof-targetd"
cd python/tests
PYTHONDONTWRITEBYTECODE=1 "../../$venv/bin/python" -m pytest -q -p no:cacheprovider
