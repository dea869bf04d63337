#!/bin/sh
# The kernel NVMe/TCP host rides through a broken network path. The guest connects (through
# a proxy in the test, tests/tests/kernel_host_faults.rs) with a short keep alive timeout and a
# long controller loss timeout, prints FAULTS-READY, then runs rounds of fio random writes
# with verify until the test stops it. Meanwhile the test stalls the path past the keep alive
# timeout (the target tears the controller down) and cuts every connection; the host
# reconnects each time, and no round may see an I/O error or a verify mismatch. The test may
# also kill the guest in the middle of a round.
#
# Environment: TARGET_PORT, TARGET_NQN (required), KATO (keep alive timeout, s; default 3).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}"
: "${KATO:=3}"
[ -n "$TARGET_PORT" ] && [ -n "$TARGET_NQN" ] || fail "TARGET_PORT and TARGET_NQN are required"

step nvme connect -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN" \
    --reconnect-delay=1 --ctrl-loss-tmo=600 --keep-alive-tmo="$KATO" --nr-io-queues=2
dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
echo "FAULTS-READY"

trap 'log "stop requested"' TERM
round=0
while [ ! -e /run/stop-requested ]; do
    round=$((round + 1))
    fio_verify "$dev" 4M
    log "fio round $round verified"
done
step nvme disconnect -n "$TARGET_NQN"
log "PASS: $round fio rounds verified through stalls and cuts"
