#!/bin/bash
# The async API and the queue pairs beside SPDK's host, against SPDK's target and against ours,
# on a 16-core machine: targets on CPUs 0-7 (8 reactors each), clients on CPUs 8-15.
#
#   benches/scripts/async-api-vs-spdk.sh OUT_DIR BIN_DIR SPDK_DIR [ROUNDS] [MODE]
#
# MODE is all (the default: SPDK's target, then ours, then QD1 with the targets in turn), spdk
# or ours (one target only, QD1 included: run the two in turn on one machine start to stay under
# a time limit per command), or qd1-interleaved (QD1 with the targets in turn only).
#
# QD1 with the targets in turn: each round starts and stops the two targets in turn (SPDK's
# first on odd rounds) and measures QD1 against each, so that QD1 against one target is measured
# a minute, not tens of minutes, from QD1 against the other (a drifting machine start moved
# QD1 by more than the targets differ when the rounds against one target ran after all those
# against the other).
#
# BIN_DIR holds nvmeof-targetd and nvmeof-bench (release builds); SPDK_DIR holds nvmf_tgt and
# spdk_nvme_perf, built from SPDK's public source (both run with --no-huge). For SPDK's
# nvmf_tgt (1 GiB malloc bdev, 4 KiB blocks) and then for nvmeof-targetd (mem:1G): a prefill
# writes the whole namespace, then ROUNDS (default 3) rounds run, each client in turn at each
# point (in the reverse order on even rounds), so that the machine's drift reaches every
# client alike: QD128 from one core (spdk_nvme_perf -c 0x100, the async API, the queue pairs),
# the same with two queue pairs (-P 2), QD128 from eight (-c 0xFF00, eight workers with a queue
# pair each), QD1 latency (-L, the async API; with the targets in turn in mode all). The jobs are those of
# benches/jobs/async-api-16core.toml, one at a time (--jobs). The CPU topology (lscpu -e), logs,
# the load generator's JSON and every point (points.txt) go to OUT_DIR; the medians per point
# and client are printed at the end.
set -u
out=$1 bin=$2 spdk=$3 rounds=${4:-3} mode=${5:-all}
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

# One point: CLIENT is perf (spdk_nvme_perf with ARGS) or a job of the job file.
point_args() { # POINT CLIENT: spdk_nvme_perf's arguments or our job at that point (none: not run)
    case $1-$2 in
        x1-perf) echo "-c 0x100 -q 128" ;;
        x1-async) echo 4k-randread-qd128-async ;;
        x1-rtc) echo 4k-randread-qd128-rtc ;;
        q2-perf) echo "-c 0x100 -q 128 -P 2" ;;
        q2-async) echo 4k-randread-qd128-async-q2 ;;
        q2-rtc) echo 4k-randread-qd128-rtc-q2 ;;
        x8-perf) echo "-c 0xFF00 -q 128" ;;
        x8-async) echo 4k-randread-qd128-async-8 ;;
        x8-rtc) echo 4k-randread-qd128-rtc-8 ;;
        qd1-perf) echo "-c 0x100 -q 1 -L" ;;
        qd1-async) echo 4k-randread-qd1-async ;;
    esac
}
point() { # TARGET POINT CLIENT ROUND PORT NQN ARGS...
    local t=$1 pt=$2 client=$3 r=$4 port=$5 nqn=$6
    shift 6
    local log="$out/$t-$pt-$client-$r.log" iops p50 p99
    if [ "$client" = perf ]; then
        "$spdk/spdk_nvme_perf" --no-huge -s 2048 -o 4096 -w randread -t 5 "$@" \
            -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$nqn" > "$log" 2>&1
        iops=$(awk '/^Total/ {print $3}' "$log")
        p50=$(awk '/^ +50\.00000%/ {sub("us", "", $3); print $3; exit}' "$log")
        p99=$(awk '/^ +99\.00000%/ {sub("us", "", $3); print $3; exit}' "$log")
    else
        "$bin/nvmeof-bench" "$job" --jobs "$1" --repeat 1 --no-prefill \
            --modes "tcp=127.0.0.1:$port" --nqn "$nqn" --client-cpus 8-15 \
            --json "$out/$t-$pt-$client-$r.json" > "$log" 2>&1
        local line
        line=$(grep elapsed "$log" | sed 's/.*\] //')
        iops=$(echo "$line" | sed -E 's/.*: ([0-9.]+)([KM]) IOPS.*/\1 \2/' |
            awk '{print $1 * ($2 == "M" ? 1000000 : 1000)}')
        p50=$(echo "$line" | sed -E 's/.*p50 ([0-9.]+) us.*/\1/')
        p99=$(echo "$line" | sed -E 's/.*p99 ([0-9.]+) us.*/\1/')
    fi
    echo "$t $pt $client $r ${iops:-0} ${p50:--} ${p99:--}" | tee -a "$out/points.txt"
}

prefill() { # TARGET PORT NQN
    # The prefill first, so that every client reads written data: a memory namespace reads
    # blocks never written as zeros without touching namespace memory, which costs its
    # target far less per read.
    "$bin/nvmeof-bench" "$job" --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s \
        --modes "tcp=127.0.0.1:$2" --nqn "$3" > "$out/$1-prefill.log" 2>&1
}

side() { # TARGET PORT NQN POINTS
    local t=$1 port=$2 nqn=$3 points=$4
    prefill "$t" "$port" "$nqn"
    for r in $(seq "$rounds"); do
        # Odd rounds run the clients of each point in one order, even rounds in the reverse
        # order, so that a drift of the machine within a round favours no client.
        local order="perf async rtc"
        [ $((r % 2)) = 0 ] && order="rtc async perf"
        for pt in $points; do
            for c in $order; do
                local args
                args=$(point_args "$pt" "$c")
                if [ -n "$args" ]; then
                    # shellcheck disable=SC2086 # the arguments split on purpose
                    point "$t" "$pt" "$c" "$r" "$port" "$nqn" $args
                fi
            done
        done
    done
}

start_spdk() {
    taskset -c 0-7 "$spdk/nvmf_tgt" -m 0xFF --no-huge -s 4096 --json "$out/spdk.json" \
        > "$out/nvmf_tgt.log" 2>&1 &
    tp=$!
    wait_port 4421
}
start_ours() {
    taskset -c 0-7 "$bin/nvmeof-targetd" --listen tcp://127.0.0.1:4420 -n "$nqn_ours" \
        --namespace mem:1G --allow-any-host --reactors 8 > "$out/targetd.log" 2>&1 &
    tp=$!
    wait_port 4420
}
qd1_turn() { # TARGET PORT NQN ROUND
    prefill "$1" "$2" "$3"
    for c in perf async; do
        # shellcheck disable=SC2046 # the arguments split on purpose
        point "$1" qd1 "$c" "$4" "$2" "$3" $(point_args qd1 "$c")
    done
}

qd1_interleaved() {
    for r in $(seq "$rounds"); do
        local order="spdk ours"
        [ $((r % 2)) = 0 ] && order="ours spdk"
        for t in $order; do
            if [ "$t" = spdk ]; then
                start_spdk && qd1_turn spdk 4421 "$nqn_spdk" "$r"
            else
                start_ours && qd1_turn ours 4420 "$nqn_ours" "$r"
            fi
            kill -INT $tp; wait $tp
        done
    done
}

case $mode in
    qd1-interleaved) qd1_interleaved ;;
    all)
        start_spdk && side spdk 4421 "$nqn_spdk" "x1 q2 x8"
        kill -INT $tp; wait $tp
        start_ours && side ours 4420 "$nqn_ours" "x1 q2 x8"
        kill -INT $tp; wait $tp
        qd1_interleaved
        ;;
    spdk)
        start_spdk && side spdk 4421 "$nqn_spdk" "x1 q2 x8 qd1"
        kill -INT $tp; wait $tp
        ;;
    ours)
        start_ours && side ours 4420 "$nqn_ours" "x1 q2 x8 qd1"
        kill -INT $tp; wait $tp
        ;;
    *)
        echo "unknown mode $mode: all, spdk, ours or qd1-interleaved" >&2
        exit 2
        ;;
esac

# Medians (and range) per target, point and client.
echo "target point client: IOPS median (min-max), p50 us, p99 us (medians)"
sort -k1,1 -k2,2 -k3,3 -k5,5n "$out/points.txt" | awk '
    function flush() {
        if (n == 0) return
        printf "%s: %.0f (%.0f-%.0f), p50 %s, p99 %s\n", key, v[int((n + 1) / 2)], v[1], v[n],
            med(a50, n), med(a99, n)
    }
    function med(a, n,   i, j, t) {
        for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] + 0 < a[i] + 0) {
            t = a[i]; a[i] = a[j]; a[j] = t
        }
        return a[int((n + 1) / 2)]
    }
    { k = $1 " " $2 " " $3
      if (k != key) { flush(); key = k; n = 0 }
      n++; v[n] = $5; a50[n] = $6; a99[n] = $7 }
    END { flush() }'
