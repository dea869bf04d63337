#!/bin/bash
# gpu_loader 4 KiB random reads, old (try_join_all per batch) and new (Namespace::read_many) in turn.
set -u  # OUT: a folder for the logs
D=${1:?usage: ab.sh DIR (DIR/head, DIR/new: nvmeof-targetd and gpu_loader builds; DIR/perf: perf)}; P=$D/perf
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
NQN=nqn.2026-11.io.nvmeof-direct:bench
wait_port() { for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }
taskset -c 0-7 $D/head/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $NQN --namespace mem:4G --allow-any-host --reactors 8 > $OUT/targetd.log 2>&1 &
T=$!; wait_port 4420
for r in 1 2 3; do
 order="head new"; [ $((r % 2)) = 0 ] && order="new head"
 for b in 128 256; do
  for c in $order; do
   n=$c-b$b-$r
   taskset -c 8-15 timeout 60 $D/$c/gpu_loader 127.0.0.1:4420 $NQN --queues 8 --tasks 8 --threads 8 --workloads rand --paths nvme,host --repeats 1 --region-mib 2048 --batch $b --slots-per-call 1 --lanes 2 --seconds 3 > $OUT/$n.log 2>&1
   echo "$n $(grep -E '^run 0' $OUT/$n.log | sed -E 's/.*(nvme|host): +([0-9.]+ GB\/s) +([0-9]+ IOPS).*/\1 \3/' | tr '\n' ' ')"
  done
 done
done
taskset -c 8-15 timeout 60 $D/new/gpu_loader 127.0.0.1:4420 $NQN --queues 8 --tasks 8 --threads 8 --workloads rand --paths nvme --repeats 1 --region-mib 2048 --batch 128 --slots-per-call 1 --lanes 2 --seconds 7 > $OUT/prof.log 2>&1 &
b=$!
for _ in $(seq 200); do grep -q "^das:" $OUT/prof.log && break; sleep 0.1; done
sleep 2.5; LD_LIBRARY_PATH=$P/lib $P/perf record -F 2999 -C 8-15 -o /tmp/new.data -- sleep 2 > /dev/null 2>&1; wait $b
echo "prof: $(grep -E '^run 0' $OUT/prof.log | cut -c1-60)"
LD_LIBRARY_PATH=$P/lib $P/perf report -i /tmp/new.data --no-children --sort dso,sym --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -60 > $OUT/new.sym.txt
LD_LIBRARY_PATH=$P/lib $P/perf report -i /tmp/new.data --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -8 > $OUT/new.dso.txt
kill -INT $T; wait $T
