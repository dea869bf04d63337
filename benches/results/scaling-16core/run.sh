#!/bin/bash
# Scaling run on the 16-core machine: writes everything under $OUT.
set -u
B=$(cd "$(dirname "$0")" && pwd)
JOB=benches/jobs/scaling-16core.toml
FINAL=${OUT:-/tmp/scaling-final}
O=/tmp/scaling-work
rm -rf "$O"; mkdir -p "$FINAL"
mkdir -p "$O"
ts() { while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N)" "$l"; done; }
{
  echo "date_utc: $(date -u +%FT%TZ)"
  echo "nproc: $(nproc)"
  echo "--- uname -a"; uname -a
  echo "--- /proc/version"; cat /proc/version
  echo "--- dmesg | head"; dmesg 2>&1 | head -20
  echo "--- lscpu"; lscpu
  echo "--- lscpu -e"; lscpu -e 2>&1
  echo "--- siblings of cpu0"; cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list 2>&1
  echo "--- free -m"; free -m
  echo "--- meminfo"; head -3 /proc/meminfo
  echo "--- nvidia-smi -L"; nvidia-smi -L 2>&1
  echo "--- taskset"; command -v taskset; taskset -p $$ 2>&1
  echo "--- pinned to 3: $(taskset -c 3 grep Cpus_allowed_list /proc/self/status 2>&1)"
  echo "--- /proc/stat before/after a 1 s busy loop pinned to CPU 3"
  grep '^cpu' /proc/stat
  taskset -c 3 timeout 1 sh -c 'while :; do :; done'
  grep '^cpu' /proc/stat
  echo "--- net"; cat /proc/sys/net/ipv4/tcp_rmem /proc/sys/net/ipv4/tcp_wmem /proc/sys/net/core/somaxconn 2>&1
  echo "--- cgroup"; cat /proc/self/cgroup 2>&1 | head; cat /sys/fs/cgroup/cpu.max 2>&1
  echo "--- binaries"; ls -l "$B"; "$B/nvmeof-bench" --version
} > "$O/machine.txt" 2>&1
PIN=(--target-cpus 0-7 --client-cpus 8-15)
command -v taskset >/dev/null || { PIN=(); echo "no taskset: unpinned" >> "$O/machine.txt"; }
( while :; do echo "T $(date +%s.%N)"; grep '^cpu' /proc/stat; sleep 1; done > "$O/procstat.txt" ) &
SAMPLER=$!
run() {
  local name=$1; shift
  echo "== $name start $(date -u +%FT%TZ) $(date +%s.%N)" >> "$O/timeline.txt"
  "$B/nvmeof-bench" "$JOB" "${PIN[@]}" "$@" --json "$O/$name.json" --markdown "$O/$name.md" \
      > "$O/$name.out" 2> >(ts > "$O/$name.err")
  echo "== $name rc=$? end $(date -u +%FT%TZ) $(date +%s.%N)" >> "$O/timeline.txt"
  tar czf "$FINAL/results.tgz.tmp" -C "$O" . ; mv -f "$FINAL/results.tgz.tmp" "$FINAL/results.tgz"
}
run r1 --target-reactors 1 --repeat 3
run r2 --modes tcp-bin --target-reactors 2 --repeat 3
run r4 --modes tcp-bin --target-reactors 4 --repeat 3
run r8 --modes tcp-bin --target-reactors 8 --repeat 3
run poll100 --modes tcp-bin --target-reactors 1 --target-poll-us 100 --repeat 3
run r8-noverify --target-reactors 8 --no-verify --repeat 1
kill $SAMPLER
tar czf "$FINAL/results.tgz" -C "$O" .
cat "$O/timeline.txt"
for f in "$O"/*.md; do echo "### $f"; cat "$f"; done
