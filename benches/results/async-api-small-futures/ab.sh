#!/bin/bash
# Paired rounds, one client core, QD128: the async API of builds old and new and spdk_nvme_perf
# in a rotating order. Part q2: two queue pairs on one client core (CPU 8) against
# nvmeof-targetd (8 reactors on CPUs 0-7; two reactors serve the client, the client is the
# limit), perf with -P 2. Part x1: one queue pair against nvmeof-targetd and SPDK's nvmf_tgt.
#   ab.sh Q2ROUNDS X1ROUNDS   (.devbin/old: the previous build, .devbin/new: the new one,
#   .devbin/spdk: spdk_nvme_perf, nvmf_tgt and their libraries; .devbin/q2.toml: q2.toml here)
set -u
D=.devbin; RQ=${1:-6}; RX=${2:-5}
NQN=nqn.2026-11.io.nvmeof-direct:bench
JOB=benches/jobs/async-api-16core.toml
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
iops_of() { grep elapsed $1 | tail -1 | sed -E 's/.*: ([0-9.]+)([KM]) IOPS.*/\1 \2/' | awk '{print $1 * ($2 == "M" ? 1000000 : 1000)}'; }
run1() { # PART PORT NQN WHO
  local log=$OUT/$1-$4-$r.log v P=1 jobf=$JOB job=4k-randread-qd128-async
  [ $1 = q2 ] && { P=2; jobf=$D/q2.toml; job=q2-async; }
  if [ $4 = perf ]; then
    LD_LIBRARY_PATH=$D/spdk/lib $D/spdk/spdk_nvme_perf --no-huge -s 2048 -o 4096 -w randread -t 3 -c 0x100 -q 128 -P $P \
      -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$2 subnqn:$3" > $log 2>&1
    v=$(awk '/^Total/ {print $3}' $log)
  else
    $D/$4/nvmeof-bench $jobf --jobs $job --repeat 1 --no-prefill --runtime 3s \
      --modes tcp=127.0.0.1:$2 --nqn $3 --client-cpus 8-15 > $log 2>&1
    v=$(iops_of $log)
  fi
  echo "$1 $4 $r $v" | tee -a $OUT/points.txt
}
rounds() { # PART PORT NQN ROUNDS
  for r in $(seq $4); do
    case $((r % 3)) in 1) o="old new perf";; 2) o="new perf old";; 0) o="perf old new";; esac
    for w in $o; do run1 $1 $2 $3 $w; done
  done
}
taskset -c 0-7 $D/old/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $NQN \
  --namespace mem:1G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
tp=$!; wait_port 4420
$D/new/nvmeof-bench $JOB --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s --modes tcp=127.0.0.1:4420 --nqn $NQN > $OUT/prefill.log 2>&1
rounds q2 4420 $NQN $RQ
rounds x1ours 4420 $NQN $RX
kill -INT $tp; wait $tp
cat > $OUT/spdk.json <<JSON
{"subsystems":[
 {"subsystem":"bdev","config":[{"method":"bdev_malloc_create","params":{"name":"Malloc0","num_blocks":262144,"block_size":4096}}]},
 {"subsystem":"nvmf","config":[
  {"method":"nvmf_create_transport","params":{"trtype":"TCP"}},
  {"method":"nvmf_create_subsystem","params":{"nqn":"nqn.2016-06.io.spdk:cnode1","allow_any_host":true,"serial_number":"SPDK0001"}},
  {"method":"nvmf_subsystem_add_ns","params":{"nqn":"nqn.2016-06.io.spdk:cnode1","namespace":{"bdev_name":"Malloc0"}}},
  {"method":"nvmf_subsystem_add_listener","params":{"nqn":"nqn.2016-06.io.spdk:cnode1","listen_address":{"trtype":"TCP","adrfam":"IPv4","traddr":"127.0.0.1","trsvcid":"4421"}}}
 ]}
]}
JSON
LD_LIBRARY_PATH=$D/spdk/lib taskset -c 0-7 $D/spdk/nvmf_tgt -m 0xFF --no-huge -s 4096 --json $OUT/spdk.json > $OUT/nvmf_tgt.log 2>&1 &
tp=$!; wait_port 4421
$D/new/nvmeof-bench $JOB --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s --modes tcp=127.0.0.1:4421 --nqn nqn.2016-06.io.spdk:cnode1 > $OUT/prefill-spdk.log 2>&1
rounds x1spdk 4421 nqn.2016-06.io.spdk:cnode1 $RX
kill -INT $tp; wait $tp
