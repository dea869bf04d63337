#!/bin/bash
# gpu_loader 4 KiB random reads into HBM, BATCH reads (default 256) x 2 lanes on 256-slot queues (at 256
# half the reads wait for a tag): the build before (cur) and after (new) the tag hand-off, in turn,
# order reversed each round. Usage: abtag.sh OUT [ROUNDS] [BATCH]
out=$1; R=${2:-4}; B=${3:-256}
mkdir -p $out
for r in $(seq $R); do
  if [ $((r % 2)) -eq 1 ]; then order="cur new"; else order="new cur"; fi
  for b in $order; do
    GPU_LOADER_ARGS="--workloads rand --paths nvme --repeats 3 --region-mib 2048 --batch $B --slots-per-call 1 --lanes 2 --queue-depth 256 --seconds 3" \
    TARGET_CPUS=0-7 LOADER_CPUS=8-15 initiator/examples/gpu-loader-bench.sh .devbin/$b $out/$b-$r 8:8:8:8 > $out/$b-$r.out 2>&1
    echo "== $b round $r $(date -u +%H:%M:%S)"; grep -iE "^rand 4 KiB" $out/$b-$r.out | tail -1
  done
done
