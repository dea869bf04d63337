#!/bin/bash
# The async API and the queue pairs beside SPDK's host, against SPDK's target and against ours,
# on a 16-core machine: targets on CPUs 0-7 (8 reactors each), clients on CPUs 8-15.
#
#   benches/scripts/async-api-vs-spdk.sh OUT_DIR BIN_DIR SPDK_DIR [ROUNDS]
#
# BIN_DIR holds nvmeof-targetd and nvmeof-bench (release builds); SPDK_DIR holds nvmf_tgt and
# spdk_nvme_perf, built from SPDK's public source (both run with --no-huge). Each round runs,
# for SPDK's nvmf_tgt (1 GiB malloc bdev, 4 KiB blocks) and then for nvmeof-targetd (mem:1G):
# benches/jobs/async-api-16core.toml (whose prefill writes the whole namespace first); then
# spdk_nvme_perf at QD128 from one core (-c 0x100) and from eight (-c 0xFF00), QD1 with
# latency tracking (-L), three times each. The CPU topology (lscpu -e), logs and
# the load generator's JSON go to OUT_DIR; a summary is printed.
set -u
out=$1 bin=$2 spdk=$3 rounds=${4:-1}
mkdir -p "$out"
# Which CPUs share a physical core (SMT siblings), to read the one-core rows with.
lscpu -e > "$out/lscpu.txt" 2>&1 || true
nqn_spdk=nqn.2016-06.io.spdk:cnode1
nqn_ours=nqn.2026-11.io.nvmeof-direct:bench
cat > "$out/spdk.json" <<JSON
{"subsystems":[
 {"subsystem":"bdev","config":[{"method":"bdev_malloc_create","params":{"name":"Malloc0","num_blocks":262144,"block_size":4096}}]},
 {"subsystem":"nvmf","config":[
  {"method":"nvmf_create_transport","params":{"trtype":"TCP"}},
  {"method":"nvmf_create_subsystem","params":{"nqn":"$nqn_spdk","allow_any_host":true,"serial_number":"SPDK0001"}},
  {"method":"nvmf_subsystem_add_ns","params":{"nqn":"$nqn_spdk","namespace":{"bdev_name":"Malloc0"}}},
  {"method":"nvmf_subsystem_add_listener","params":{"nqn":"$nqn_spdk","listen_address":{"trtype":"TCP","adrfam":"IPv4","traddr":"127.0.0.1","trsvcid":"4421"}}}
 ]}
]}
JSON
job=$(dirname "$0")/../jobs/async-api-16core.toml

wait_port() {
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "nothing listens on port $1" >&2
    return 1
}

perf() { # NAME PORT NQN ARGS...
    local name=$1 port=$2 nqn=$3
    shift 3
    for i in 1 2 3; do
        "$spdk/spdk_nvme_perf" --no-huge -s 2048 -o 4096 -w randread -t 5 "$@" \
            -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$nqn" \
            > "$out/$name-$i.log" 2>&1
        echo "$name $i: $(grep -E '^Total' "$out/$name-$i.log" | tr -s ' ')" \
            "$(grep -E '^ +(50|99)\.00000%' "$out/$name-$i.log" | head -2 | tr -s ' ' | tr '\n' ' ')"
    done
}

side() { # TARGET PORT NQN ROUND
    local t=$1 port=$2 nqn=$3 r=$4
    # The load generator first: its prefill writes the whole namespace, so that every client
    # reads written data. A memory namespace reads blocks never written as zeros without
    # touching namespace memory, which costs its target far less per read.
    "$bin/nvmeof-bench" "$job" --modes "tcp=127.0.0.1:$port" --nqn "$nqn" --client-cpus 8-15 \
        --json "$out/$t-bench-r$r.json" > "$out/$t-bench-r$r.log" 2>&1
    grep elapsed "$out/$t-bench-r$r.log" | sed "s/.*\] /$t bench r$r: /"
    perf "$t-perf-qd128-x1-r$r" "$port" "$nqn" -c 0x100 -q 128
    perf "$t-perf-qd128-x8-r$r" "$port" "$nqn" -c 0xFF00 -q 128
    perf "$t-perf-qd1-r$r" "$port" "$nqn" -c 0x100 -q 1 -L
}

for r in $(seq "$rounds"); do
    taskset -c 0-7 "$spdk/nvmf_tgt" -m 0xFF --no-huge -s 4096 --json "$out/spdk.json" \
        > "$out/nvmf_tgt-r$r.log" 2>&1 &
    tp=$!
    wait_port 4421 && side spdk 4421 "$nqn_spdk" "$r"
    kill -INT $tp; wait $tp
    taskset -c 0-7 "$bin/nvmeof-targetd" --listen tcp://127.0.0.1:4420 -n "$nqn_ours" \
        --namespace mem:1G --allow-any-host --reactors 8 > "$out/targetd-r$r.log" 2>&1 &
    tp=$!
    wait_port 4420 && side ours 4420 "$nqn_ours" "$r"
    kill -INT $tp; wait $tp
done
