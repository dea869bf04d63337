#!/bin/bash
# Run from the repository root: .devbin/cur/nvmeof-bench is build caa4148, .devbin/perf/ holds a perf binary (Debian linux-perf) and its libraries, the job beside it copied to .devbin/prof.toml.
# profile the client CPUs during each job: gpu first (starts ~2-3 s after launch incl. prefill), then host
out=$1; mkdir -p $out
P=".devbin/perf/perf"; export LD_LIBRARY_PATH=$PWD/.devbin/perf/lib:/usr/local/cuda/lib64
.devbin/cur/nvmeof-bench .devbin/prof.toml --target-cpus 0-7 --client-cpus 8-15 > $out/bench.log 2>&1 &
bp=$!
# wait for the gpu job to be running: the log prints progress; just sleep
sleep 7
$P record -e cpu-clock -F 999 -g -C 8-15 -o $out/gpu.data -- sleep 3 > $out/rec-gpu.txt 2>&1
sleep 5
$P record -e cpu-clock -F 999 -g -C 8-15 -o $out/host.data -- sleep 3 > $out/rec-host.txt 2>&1
wait $bp
for j in gpu host; do
  $P report -i $out/$j.data --no-children --sort dso,sym --stdio 2>/dev/null | grep -v "^$" | grep -E "^ +[0-9]" | head -70 > $out/$j-sym.txt
  $P report -i $out/$j.data --no-children --sort dso --stdio 2>/dev/null | grep -E "^ +[0-9]" | head -20 > $out/$j-dso.txt
  $P report -i $out/$j.data --children --sort sym --stdio -g none 2>/dev/null | grep -E "^ +[0-9]" | head -80 > $out/$j-children.txt
done
rm -f $out/*.data
grep -E "^\| (rand|read)" $out/bench.log
