#!/bin/bash
# 4 KiB randread x8 QD128 into HBM and into host memory against nvmeof-targetd (8 reactors,
# CPUs 0-7), clients on 8-15; head and nocopy builds in turn; perf on 8-15 for head.
set -u
D=.devbin; P=$D/perf
NQN=nqn.2026-11.io.nvmeof-direct:bench
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
taskset -c 0-7 $D/head/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $NQN --namespace mem:4G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
T=$!; wait_port 4420
for r in 1 2 3; do
for c in head nocopy; do
 for j in gpu host; do
  [ $c = nocopy ] && [ $j = host ] && continue
  n=$c-$j-$r
  $D/$c/nvmeof-bench $D/g4k.toml --jobs $j --modes tcp=127.0.0.1:4420 --nqn $NQN --client-cpus 8-15 > $OUT/$n.log 2>&1 &
  b=$!
  if [ $r = 1 ] && [ $c = head ]; then
    sleep 3.5
    LD_LIBRARY_PATH=$P/lib $P/perf record -F 2999 -C 8-15 -o /tmp/$n.data -- sleep 2 > /dev/null 2>&1
  fi
  wait $b
  echo "$n $(grep -E '^\| (rand|read)' $OUT/$n.log | cut -d'|' -f2,4,5,11,12 | tail -1)" | tee -a $OUT/iops.txt
  if [ -f /tmp/$n.data ]; then
  LD_LIBRARY_PATH=$P/lib $P/perf report -i /tmp/$n.data --no-children --sort dso,sym --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -80 > $OUT/$n.sym.txt
  LD_LIBRARY_PATH=$P/lib $P/perf report -i /tmp/$n.data --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -12 > $OUT/$n.dso.txt
  fi
 done
done
done
kill -INT $T; wait $T
