#!/bin/bash
# One client core (CPU 8) reading through two queue pairs (so that two target reactors serve it
# and the client is the limit), QD128 in all: old/new async in turn, the queue pairs, and
# spdk_nvme_perf -P 2, against nvmeof-targetd (8 reactors on CPUs 0-7). usage: abq2.sh ROUNDS
set -u
D=.devbin; R=${1:-3}
NQN=nqn.2026-11.io.nvmeof-direct:bench
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
taskset -c 0-7 $D/new/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $NQN \
  --namespace mem:1G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
tp=$!; wait_port 4420
$D/new/nvmeof-bench benches/jobs/async-api-16core.toml --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s --modes tcp=127.0.0.1:4420 --nqn $NQN > $OUT/prefill.log 2>&1
one() { # VER JOB
  local log=$OUT/$2-$1-$r.log
  $D/$1/nvmeof-bench $D/q2.toml --jobs $2 --modes tcp=127.0.0.1:4420 --nqn $NQN --client-cpus 8-15 > $log 2>&1
  echo "$2 $1 $r $(grep elapsed $log | tail -1 | sed -E 's/.*: ([0-9.]+[KM]) IOPS.*/\1/')" | tee -a $OUT/points.txt
}
for r in $(seq $R); do
  order="old new"; [ $((r % 2)) = 0 ] && order="new old"
  for v in $order; do one $v q2-async; done
  one new q2-rtc
  LD_LIBRARY_PATH=$D/spdk/lib $D/spdk/spdk_nvme_perf --no-huge -s 2048 -o 4096 -w randread -t 5 -c 0x100 -q 128 -P 2 \
    -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:$NQN" > $OUT/perf-$r.log 2>&1
  echo "perf-P2 - $r $(awk '/^Total/ {print $3}' $OUT/perf-$r.log)" | tee -a $OUT/points.txt
done
kill -INT $tp; wait $tp
