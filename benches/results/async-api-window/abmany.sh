#!/bin/bash
# Many short paired rounds at one client core, QD128, one queue pair: the async API of builds A
# and B and spdk_nvme_perf in a rotating order, against nvmeof-targetd (of build B) and SPDK's
# nvmf_tgt (8 reactors/cores on CPUs 0-7, clients on CPU 8). The builds are folders of .devbin.
#   abmany.sh ROUNDS [A B]        (paired/: old new2; unwritten-count/: new2 final)
set -u
D=.devbin; R=${1:-8}; A=${2:-old}; B=${3:-new2}
JOB=benches/jobs/async-api-16core.toml
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
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
run1() { # T PORT NQN WHO
  local log=$OUT/$1-$4-$r.log v
  if [ $4 = perf ]; then
    LD_LIBRARY_PATH=$D/spdk/lib $D/spdk/spdk_nvme_perf --no-huge -s 2048 -o 4096 -w randread -t 3 -c 0x100 -q 128 \
      -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:$2 subnqn:$3" > $log 2>&1
    v=$(awk '/^Total/ {print $3}' $log)
  else
    $D/$4/nvmeof-bench $JOB --jobs 4k-randread-qd128-async --repeat 1 --no-prefill --runtime 3s \
      --modes tcp=127.0.0.1:$2 --nqn $3 --client-cpus 8-15 > $log 2>&1
    v=$(grep elapsed $log | tail -1 | sed -E 's/.*: ([0-9.]+)([KM]) IOPS.*/\1 \2/' | awk '{print $1 * ($2 == "M" ? 1000000 : 1000)}')
  fi
  echo "$1 $4 $r $v" | tee -a $OUT/points.txt
}
side() { # T PORT NQN
  $D/$B/nvmeof-bench $JOB --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s --modes tcp=127.0.0.1:$2 --nqn $3 > $OUT/$1-prefill.log 2>&1
  for r in $(seq $R); do
    case $((r % 3)) in 1) o="$A $B perf";; 2) o="$B perf $A";; 0) o="perf $A $B";; esac
    for w in $o; do run1 $1 $2 $3 $w; done
  done
}
taskset -c 0-7 $D/$B/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n nqn.2026-11.io.nvmeof-direct:bench \
  --namespace mem:1G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
tp=$!; wait_port 4420 && side ours 4420 nqn.2026-11.io.nvmeof-direct:bench
kill -INT $tp; wait $tp
LD_LIBRARY_PATH=$D/spdk/lib taskset -c 0-7 $D/spdk/nvmf_tgt -m 0xFF --no-huge -s 4096 --json $OUT/spdk.json > $OUT/nvmf_tgt.log 2>&1 &
tp=$!; wait_port 4421 && side spdk 4421 nqn.2016-06.io.spdk:cnode1
kill -INT $tp; wait $tp
