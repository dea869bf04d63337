#!/bin/bash
# Profiles one client core (CPU 8) reading through two queue pairs at QD128 against
# nvmeof-targetd (8 reactors on CPUs 0-7): builds old and new in turn, two rounds, and
# spdk_nvme_perf -P 2 once per round.
set -u
D=.devbin; P=$D/perf
NQN=nqn.2026-11.io.nvmeof-direct:bench
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
taskset -c 0-7 $D/old/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $NQN --namespace mem:1G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
T=$!; wait_port 4420
$D/new/nvmeof-bench benches/jobs/async-api-16core.toml --jobs 4k-randread-qd1-async --repeat 1 --runtime 1s --modes tcp=127.0.0.1:4420 --nqn $NQN > $OUT/prefill.log 2>&1
for r in 1 2; do
order="old new perf"; [ $r = 2 ] && order="perf new old"
for c in $order; do
  n=$c-$r
  if [ $c = perf ]; then
    LD_LIBRARY_PATH=$D/spdk/lib $D/spdk/spdk_nvme_perf --no-huge -s 2048 -o 4096 -w randread -t 7 -c 0x100 -q 128 -P 2 \
      -r "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:$NQN" > $OUT/$n.log 2>&1 &
  else
    $D/$c/nvmeof-bench $D/q2.toml --jobs q2-async --runtime 6s --modes tcp=127.0.0.1:4420 --nqn $NQN --client-cpus 8-15 > $OUT/$n.log 2>&1 &
  fi
  b=$!
  sleep 2.5
  LD_LIBRARY_PATH=$P/lib $P/perf record -F 4999 -C 8 -o /tmp/$n.data -- sleep 2 > /dev/null 2>&1
  wait $b
  echo "$n $(grep -E 'elapsed|^Total' $OUT/$n.log | tail -1)" | tee -a $OUT/iops.txt
  LD_LIBRARY_PATH=$P/lib $P/perf report -i /tmp/$n.data --no-children --sort dso,sym --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -70 > $OUT/$n.sym.txt
  LD_LIBRARY_PATH=$P/lib $P/perf report -i /tmp/$n.data --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -12 > $OUT/$n.dso.txt
done
done
kill -INT $T; wait $T
