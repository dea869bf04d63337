#!/bin/bash
# gpu_loader 4 KiB random reads into HBM: batch/lanes/queue-depth variants in turn
out=$1; shift
mkdir -p $out
for r in 1 2; do
  for v in "256 2 256" "128 2 256" "64 4 256" "64 2 128"; do
    set -- $v; tag="b$1-l$2-q$3"
    GPU_LOADER_ARGS="--workloads rand --paths nvme --repeats 3 --region-mib 2048 --batch $1 --slots-per-call 1 --lanes $2 --queue-depth $3 --seconds 3" \
    TARGET_CPUS=0-7 LOADER_CPUS=8-15 initiator/examples/gpu-loader-bench.sh .devbin/cur $out/$tag-$r 8:8:8:8 > $out/$tag-$r.out 2>&1
    echo "== $tag round $r"; grep -iE "rand|median" $out/$tag-$r.out | tail -4
  done
done
