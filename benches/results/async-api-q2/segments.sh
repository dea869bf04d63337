#!/bin/bash
# TCP segments per read for each client at x1 and x8, against nvmf_tgt and ours.
#   segments.sh OUT  (run from the repository root; .devbin/head: nvmeof-bench and nvmeof-targetd,
#   .devbin/spdk: spdk_nvme_perf, nvmf_tgt and their libraries)
set -u
D=.devbin; OUT=$1
NQN_O=nqn.2026-11.io.nvmeof-direct:bench; NQN_S=nqn.2016-06.io.spdk:cnode1
JOB=benches/jobs/async-api-16core.toml
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
segs() { awk '/^Tcp:/ && n++ {print $11, $12}' /proc/net/snmp; }   # InSegs OutSegs
one() { # TGT PT CLIENT PORT NQN
  local log=$OUT/$1-$2-$3.log a b v
  a=$(segs)
  if [ $3 = perf ]; then
    local c=0x100; [ $2 = x8 ] && c=0xFF00
    $D/spdk/spdk_nvme_perf --no-huge -s 2048 -o 4096 -w randread -t 4 -c $c -q 128 \
      -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$4 subnqn:$5" > $log 2>&1
    v=$(awk '/^Total/ {print $3}' $log)
  else
    local j=4k-randread-qd128-$3; [ $2 = x8 ] && j=$j-8
    [ $3 = async ] && { j=4k-randread-qd128-async; [ $2 = x8 ] && j=4k-randread-qd128-async-8; }
    $D/head/nvmeof-bench $JOB --jobs $j --repeat 1 --no-prefill --runtime 4s --ramp-time 0s \
      --modes tcp=127.0.0.1:$4 --nqn $5 --client-cpus 8-15 > $log 2>&1
    v=$(grep elapsed $log | tail -1 | sed -E 's/.*: ([0-9.]+)([KM]) IOPS.*/\1 \2/' | awk '{print $1 * ($2 == "M" ? 1000000 : 1000)}')
  fi
  b=$(segs)
  echo "$1 $2 $3 $v $a $b" | awk '{ios=$4*4; printf "%s %s %s iops %d segs/read %.3f (in %d out %d)\n", $1,$2,$3,$4,($7-$5)/ios,$7-$5,$8-$6}' | tee -a $OUT/segs.txt
}
side() { for pt in x1 x8; do for c in perf async rtc perf async; do one $1 $pt $c $2 $3; done; done; }
cat > $OUT/spdk.json <<JSON
{"subsystems":[
 {"subsystem":"bdev","config":[{"method":"bdev_malloc_create","params":{"name":"Malloc0","num_blocks":262144,"block_size":4096}}]},
 {"subsystem":"nvmf","config":[
  {"method":"nvmf_create_transport","params":{"trtype":"TCP"}},
  {"method":"nvmf_create_subsystem","params":{"nqn":"$NQN_S","allow_any_host":true,"serial_number":"SPDK0001"}},
  {"method":"nvmf_subsystem_add_ns","params":{"nqn":"$NQN_S","namespace":{"bdev_name":"Malloc0"}}},
  {"method":"nvmf_subsystem_add_listener","params":{"nqn":"$NQN_S","listen_address":{"trtype":"TCP","adrfam":"IPv4","traddr":"127.0.0.1","trsvcid":"4421"}}}
 ]}
]}
JSON
LD_LIBRARY_PATH=$D/spdk/lib taskset -c 0-7 $D/spdk/nvmf_tgt -m 0xFF --no-huge -s 4096 --json $OUT/spdk.json > $OUT/nvmf_tgt.log 2>&1 &
tp=$!; wait_port 4421
$D/head/nvmeof-bench $JOB --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s --modes tcp=127.0.0.1:4421 --nqn $NQN_S > $OUT/prefill-s.log 2>&1
export LD_LIBRARY_PATH=$D/spdk/lib
side spdk 4421 $NQN_S
kill -INT $tp; wait $tp
taskset -c 0-7 $D/head/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $NQN_O --namespace mem:1G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
tp=$!; wait_port 4420
$D/head/nvmeof-bench $JOB --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s --modes tcp=127.0.0.1:4420 --nqn $NQN_O > $OUT/prefill-o.log 2>&1
side ours 4420 $NQN_O
kill -INT $tp; wait $tp
