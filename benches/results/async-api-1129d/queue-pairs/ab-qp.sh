#!/bin/bash
# Run from the repository root, release binaries of build f4b1e49 (2026-11-26) in .devbin/old and of caa4148 in .devbin/cur, the job beside it copied to .devbin/qp8.toml.
# old/new whole builds in turn, each with its own in-process target
out=$1; mkdir -p $out
for r in 1 2 3; do
  if [ $((r % 2)) = 1 ]; then order="old cur"; else order="cur old"; fi
  for b in $order; do
    timeout 60 .devbin/$b/nvmeof-bench .devbin/qp8.toml --target-cpus 0-7 --client-cpus 8-15 > $out/$b-$r.log 2>&1
    echo "round $r $b: $(grep -E '^\| rand' $out/$b-$r.log | cut -d'|' -f2,4 | tr '\n' ' ')"
  done
done
