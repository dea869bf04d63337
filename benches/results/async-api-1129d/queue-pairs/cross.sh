#!/bin/bash
# Run from the repository root, release binaries of build f4b1e49 (2026-11-26) in .devbin/old and of caa4148 in .devbin/cur, the job beside it copied to .devbin/qp8.toml.
# each target build (separate nvmeof-targetd on CPUs 0-7) against each client build (CPUs 8-15)
out=$1; mkdir -p $out
nqn=nqn.2026-11.io.nvmeof-direct:bench
for t in old cur; do
  taskset -c 0-7 .devbin/$t/nvmeof-targetd --listen tcp://127.0.0.1:4420 -n $nqn --namespace mem:1G --allow-any-host --reactors 8 > $out/targetd-$t.log 2>&1 &
  tp=$!
  for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/4420) 2>/dev/null && break; sleep 0.1; done
  timeout 60 .devbin/cur/nvmeof-bench .devbin/qp8.toml --repeat 1 --runtime 1s --modes tcp=127.0.0.1:4420 --nqn $nqn > $out/prefill-$t.log 2>&1
  for r in 1 2; do
    if [ $r = 1 ]; then order="old cur"; else order="cur old"; fi
    for c in $order; do
      timeout 60 .devbin/$c/nvmeof-bench .devbin/qp8.toml --no-prefill --modes tcp=127.0.0.1:4420 --nqn $nqn --client-cpus 8-15 > $out/t$t-c$c-$r.log 2>&1
      echo "target $t client $c round $r: $(grep -E '^\| rand' $out/t$t-c$c-$r.log | cut -d'|' -f2,4 | tr '\n' ' ')"
    done
  done
  kill $tp; wait $tp 2>/dev/null
done
