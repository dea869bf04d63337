#!/bin/bash
# Run from the repository root: .devbin/cur/nvmeof-bench is build caa4148, .devbin/new/nvmeof-bench the poller waiting for every arrival (no threshold), the jobs beside it copied to .devbin/.
# caa4148 (cur) and the gather's poller waiting for arrivals (new), in turn, ROUNDS rounds (default 3):
#   gab.sh OUT [ROUNDS]
out=$1 rounds=${2:-3}; mkdir -p $out
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for r in $(seq $rounds); do
  if [ $((r % 2)) = 1 ]; then order="cur new"; else order="new cur"; fi
  for b in $order; do
    timeout 60 .devbin/$b/nvmeof-bench .devbin/gab.toml --target-cpus 0-7 --client-cpus 8-15 > $out/$b-$r.log 2>&1
    echo "round $r $b: $(grep -E '^\| rand' $out/$b-$r.log | cut -d'|' -f2,4,6,7,8,11,12 | tr '\n' ' ')"
  done
done
timeout 100 .devbin/new/nvmeof-bench .devbin/gver.toml --target-cpus 0-7 --client-cpus 8-15 > $out/verify.log 2>&1; echo "verify rc=$?"
grep -E "^\| rand|error|mismatch" $out/verify.log | cut -c1-200
