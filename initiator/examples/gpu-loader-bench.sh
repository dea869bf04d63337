#!/usr/bin/env bash
# Runs the gpu_loader example against nvmeof-targetd on loopback (memory namespace): 1 MiB
# sequential and 4 KiB random reads into GPU memory over NVMe/TCP, next to the same reads from
# local memory, for several splits of the machine's cores between target and initiator.
#
#   initiator/examples/gpu-loader-bench.sh BIN_DIR [LOG_DIR] [CONFIG...]
#
# BIN_DIR holds nvmeof-targetd and gpu_loader (release builds). A CONFIG is
# REACTORS:QUEUES:TASKS:THREADS (target reactors, I/O queues, loader tasks, loader runtime
# threads; keep QUEUES = THREADS: each runtime thread sticks to one queue); the default set
# suits a 16-core machine. Extra loader flags go in GPU_LOADER_ARGS, extra target flags (e.g.
# --poll-us 50) in TARGETD_ARGS. TARGET_CPUS and LOADER_CPUS (taskset lists, e.g. 0-7 and 8-15)
# keep the target and the loader on CPUs of their own.
set -u -o pipefail

bin="${1:?usage: gpu-loader-bench.sh BIN_DIR [LOG_DIR] [CONFIG...]}"
logs="${2:-.}"
shift $(($# < 2 ? $# : 2))
configs=("$@")
[ "${#configs[@]}" -gt 0 ] || configs=("8:8:32:8" "6:10:40:10")
nqn="nqn.2026-11.io.nvmeof-direct:gpu-loader"
port=4420
mkdir -p "$logs"

# libnvrtc for the kernels (the same places run-gpu-tests.sh looks).
for d in ${CUDA_HOME:+"$CUDA_HOME/lib64"} /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/cuda-*/lib64 /usr/local/cuda-*/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu; do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then
        export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        break
    fi
done
if ! ls ${LD_LIBRARY_PATH//:/ } 2>/dev/null | grep -q libnvrtc && command -v python3 >/dev/null; then
    d="$(python3 -c 'import glob,site,sys
for p in site.getsitepackages()+sys.path:
    for l in sorted(glob.glob(p+"/nvidia/cu1*/lib/libnvrtc.so*")+glob.glob(p+"/nvidia/cuda_nvrtc/lib/libnvrtc.so*")):
        print(l.rsplit("/",1)[0]); raise SystemExit' 2>/dev/null)"
    [ -n "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
echo "cores: $(nproc); date: $(date -u +%Y-%m-%dT%H:%MZ)"

rc=0
for cfg in "${configs[@]}"; do
    IFS=: read -r reactors queues tasks threads <<< "$cfg"
    log="$logs/gpu-loader-r${reactors}-q${queues}-t${tasks}.log"
    ${TARGET_CPUS:+taskset -c "$TARGET_CPUS"} "$bin/nvmeof-targetd" --listen "tcp://127.0.0.1:$port" -n "$nqn" --namespace mem:4G --reactors "$reactors" \
        ${TARGETD_ARGS:-} >> "$logs/targetd.log" 2>&1 &
    tpid=$!
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
        sleep 0.1
    done
    echo "=== target reactors $reactors ${TARGETD_ARGS:-}, $queues queues, $tasks tasks, $threads threads"
    ${LOADER_CPUS:+taskset -c "$LOADER_CPUS"} "$bin/gpu_loader" "127.0.0.1:$port" "$nqn" --queues "$queues" --tasks "$tasks" \
        --threads "$threads" ${GPU_LOADER_ARGS:-} 2>&1 | tee "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    kill "$tpid"
    wait "$tpid" 2>/dev/null
done
exit "$rc"
