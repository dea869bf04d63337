#!/bin/bash
# Run from the repository root, release binaries of build caa4148 in .devbin/cur, the job beside it copied to .devbin/jx.toml, tcp-ceiling.py in .devbin.
out=$1; mkdir -p $out
nqn=nqn.2026-11.io.nvmeof-direct:bench
inp() { timeout 100 .devbin/cur/nvmeof-bench .devbin/jx.toml --target-cpus 0-7 --client-cpus 8-15 > $out/inproc-$1.log 2>&1; echo "in-process $1: $(grep -E '^\| (rand|read)' $out/inproc-$1.log | cut -d'|' -f2,4 | tr '\n' ' ')"; }
sep() {
  taskset -c 0-7 .devbin/cur/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $nqn --namespace mem:4G --allow-any-host --reactors 8 > $out/targetd-$1.log 2>&1 &
  tp=$!
  for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/4420) 2>/dev/null && break; sleep 0.1; done
  timeout 100 .devbin/cur/nvmeof-bench .devbin/jx.toml --modes tcp=127.0.0.1:4420 --nqn $nqn --client-cpus 8-15 > $out/sep-$1.log 2>&1
  echo "separate $1: $(grep -E '^\| (rand|read)' $out/sep-$1.log | cut -d'|' -f2,4 | tr '\n' ' ')"
  kill $tp; wait $tp 2>/dev/null
}
python3 .devbin/tcp-ceiling.py 8
inp 1; sep 1; sep 2; inp 2
python3 .devbin/tcp-ceiling.py 8
