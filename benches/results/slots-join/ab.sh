#!/bin/bash
# Load generator: slot futures joined by join_all (cur, 7e8f199) and by slots::join (sj), in turn.
set -u  # OUT: a folder for the logs
D=${1:?usage: ab.sh DIR (DIR/cur: nvmeof-targetd and nvmeof-bench of 7e8f199; DIR/sj: nvmeof-bench with slots::join; DIR/g4k.toml)}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
NQN=nqn.2026-11.io.nvmeof-direct:bench
J=benches/jobs/async-api-16core.toml
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
taskset -c 0-7 $D/cur/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $NQN --namespace mem:4G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
T=$!; wait_port 4420
for r in 1 2 3; do
 order="cur sj"; [ $((r % 2)) = 0 ] && order="sj cur"
 for j in 4k-randread-qd128-async 4k-randread-qd128-async-q2 4k-randread-qd128-async-8 gpu; do
  for c in $order; do
   n=$c-$j-$r
   if [ $j = gpu ]; then
     timeout 40 $D/$c/nvmeof-bench $D/g4k.toml --jobs gpu --modes tcp=127.0.0.1:4420 --nqn $NQN --client-cpus 8-15 > $OUT/$n.log 2>&1
   else
     timeout 40 $D/$c/nvmeof-bench $J --jobs $j --repeat 1 --no-prefill --modes tcp=127.0.0.1:4420 --nqn $NQN --client-cpus 8-15 > $OUT/$n.log 2>&1
   fi
   echo "$n $(grep -E '^\| (rand|read)' $OUT/$n.log | cut -d'|' -f2,4,5,11,12 | tail -1)"
  done
 done
done
kill -INT $T; wait $T
