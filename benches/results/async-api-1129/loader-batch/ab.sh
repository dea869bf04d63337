#!/bin/bash
# gpu_loader 4 KiB random reads into HBM: batch 256 vs 128 (two lanes, queue depth 256), in turn, order reversed each round
out=$1; R=${2:-3}
mkdir -p $out
for r in $(seq $R); do
  if [ $((r % 2)) -eq 1 ]; then order="256 128"; else order="128 256"; fi
  for b in $order; do
    tag="b$b-l2-q256"
    GPU_LOADER_ARGS="--workloads rand --paths nvme --repeats 3 --region-mib 2048 --batch $b --slots-per-call 1 --lanes 2 --queue-depth 256 --seconds 3" \
    TARGET_CPUS=0-7 LOADER_CPUS=8-15 initiator/examples/gpu-loader-bench.sh .devbin/cur $out/$tag-$r 8:8:8:8 > $out/$tag-$r.out 2>&1
    echo "== $tag round $r $(date -u +%H:%M:%S)"; grep -iE "^rand 4 KiB" $out/$tag-$r.out | tail -1
  done
done
