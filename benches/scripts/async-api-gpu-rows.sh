#!/bin/bash
# The rows of G4, G5 and G7a that go into GPU memory or run at 512 B, on a 16-core GPU machine:
# our target on CPUs 0-7 (8 reactors), clients on CPUs 8-15.
#
#   benches/scripts/async-api-gpu-rows.sh OUT_DIR BIN_DIR TCP_CEILING_PY
#
# BIN_DIR holds nvmeof-bench, nvmeof-targetd and gpu_loader (release builds; gpu_loader is the
# initiator's example, `--features gpu`); TCP_CEILING_PY is the raw loopback TCP ceiling script
# (tcp-ceiling.py). In order: the ceiling, 4 KiB random reads into HBM and 1 MiB reads into host
# memory and into HBM (benches/jobs/async-api-gpu-16core.toml), the ceiling again, loopback TCP
# plus one copy to the GPU per byte (benches/scripts/tcp-gpu-ceiling.py), CPU-issued and
# GPU-issued 512 B reads (benches/jobs/async-api-512-16core.toml), then gpu_loader's 4 KiB
# random reads into HBM (and RAM -> HBM, and into host memory) at 128 and at 256 reads per call,
# two calls in flight per task, 8 tasks on 8 queues of depth 256. Logs, JSON and the times go
# to OUT_DIR; the figures are printed as they come. About 3 minutes.
set -u
out=$1 bin=$2 ceiling=$3
mkdir -p "$out"
date -u > "$out/start.txt"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
cpus=(--target-cpus 0-7 --client-cpus 8-15)
rows() { grep -E "^\| (rand|read)" "$1" | cut -d'|' -f2,4,5,11,12; }
python3 "$ceiling" 8 > "$out/ceiling-1.txt" 2>&1
tail -1 "$out/ceiling-1.txt"
"$bin/nvmeof-bench" benches/jobs/async-api-gpu-16core.toml "${cpus[@]}" --json "$out/gpu.json" > "$out/gpu.log" 2>&1
rows "$out/gpu.log"
python3 "$ceiling" 8 > "$out/ceiling-2.txt" 2>&1
tail -1 "$out/ceiling-2.txt"
python3 benches/scripts/tcp-gpu-ceiling.py 8 > "$out/tcp-gpu-ceiling.txt" 2>&1
grep GB "$out/tcp-gpu-ceiling.txt"
"$bin/nvmeof-bench" benches/jobs/async-api-512-16core.toml "${cpus[@]}" --json "$out/512.json" > "$out/512.log" 2>&1
rows "$out/512.log"
for b in 128 256; do
    GPU_LOADER_ARGS="--workloads rand --paths nvme,das,host --repeats 3 --region-mib 2048 --batch $b --slots-per-call 1 --lanes 2 --seconds 3" \
        TARGET_CPUS=0-7 LOADER_CPUS=8-15 initiator/examples/gpu-loader-bench.sh "$bin" "$out/loader-b$b" 8:8:8:8 > "$out/loader-b$b.out" 2>&1
    echo "gpu_loader, $b reads per call"
    grep -A4 "^workload" "$out/loader-b$b.out"
done
date -u >> "$out/start.txt"
