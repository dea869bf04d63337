#!/bin/bash
# gpu_loader, 4 KiB random reads into HBM, old and new build in turn (order reversed each round),
# 128 and 256 reads per call, two calls in flight per task. usage: abgl.sh ROUNDS
set -u
R=${1:-3}; out=$OUT
for r in $(seq $R); do
  if [ $((r % 2)) -eq 1 ]; then order="old new2"; else order="new2 old"; fi
  for b in 128 256; do
    for v in $order; do
      GPU_LOADER_ARGS="--workloads rand --paths nvme --repeats 1 --region-mib 2048 --batch $b --slots-per-call 1 --lanes 2 --seconds 3" \
      TARGET_CPUS=0-7 LOADER_CPUS=8-15 initiator/examples/gpu-loader-bench.sh .devbin/$v $out/gl-$v-$b-$r 8:8:8:8 > $out/gl-$v-$b-$r.out 2>&1
      echo "b$b $v $r $(grep -iE '^rand 4 KiB' $out/gl-$v-$b-$r.out | tail -1)"
    done
  done
done
