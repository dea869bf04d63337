#!/bin/sh
# Data survives a crash of nvmeof-targetd, and the kernel host reconnects to the restarted
# daemon. The namespace has a volatile write cache (volatile_cache=). The guest writes a random
# pattern through the kernel host and flushes, writes a block range with Force Unit Access and
# another plainly (nvme-cli passthrough, no flush after either), prints DATA-WRITTEN and waits;
# the test (tests/tests/kernel_host.rs) then kills the daemon with SIGKILL and starts it again
# on the same file; the host reconnects and the guest reads back the flushed pattern and the
# FUA range, and finds the plain range gone (zeros, as the fresh file held).
#
# Environment: TARGET_PORT, TARGET_NQN (required).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}"
[ -n "$TARGET_PORT" ] && [ -n "$TARGET_NQN" ] || fail "TARGET_PORT and TARGET_NQN are required"

step nvme connect -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN" \
    --reconnect-delay=1 --ctrl-loss-tmo=300 --keep-alive-tmo=5
dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
ctrl=$(nvme_ctrl_for "$TARGET_NQN")
state() { cat "/sys/class/nvme/$ctrl/state" 2>/dev/null; }

step dd if=/dev/urandom of=/tmp/pattern bs=1M count=8
want=$(md5sum </tmp/pattern | cut -d' ' -f1)
step dd if=/tmp/pattern of="$dev" bs=1M seek=3 oflag=direct conv=fsync
step nvme flush "$dev"
log "pattern $want written at 3 MiB; state $(state)"

# The kernel host sees the cache (VWC) and so may send FUA.
log "write_cache $(cat /sys/block/"${dev#/dev/}"/queue/write_cache), fua $(cat /sys/block/"${dev#/dev/}"/queue/fua)"
[ "$(cat /sys/block/"${dev#/dev/}"/queue/fua)" = 1 ] || fail "the host does not use FUA on $dev"
# 64 KiB with FUA at 16 MiB, 64 KiB plain at 24 MiB (4 KiB blocks); no flush after them.
step dd if=/dev/urandom of=/tmp/fua bs=64k count=1
step dd if=/dev/urandom of=/tmp/plain bs=64k count=1
want_fua=$(md5sum </tmp/fua | cut -d' ' -f1)
want_plain=$(md5sum </tmp/plain | cut -d' ' -f1)
zeros=$(dd if=/dev/zero bs=64k count=1 2>/dev/null | md5sum | cut -d' ' -f1)
step nvme write "$dev" --start-block=4096 --block-count=15 --data-size=65536 --data=/tmp/fua \
    --force-unit-access
step nvme write "$dev" --start-block=6144 --block-count=15 --data-size=65536 --data=/tmp/plain
range() { dd if="$dev" bs=64k skip="$1" count=1 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1; }
[ "$(range 384)" = "$want_plain" ] || fail "the plain write does not read back before the crash"
echo "DATA-WRITTEN"

# Wait for the controller to lose its connection, then to come back.
i=0
while [ "$(state)" = live ]; do
    i=$((i + 1)); [ $i -lt 600 ] || fail "the controller never noticed the target going away"
    sleep 0.2
done
log "controller state: $(state)"
i=0
while [ "$(state)" != live ]; do
    i=$((i + 1)); [ $i -lt 900 ] || fail "the controller did not reconnect (state $(state))"
    sleep 0.2
done
log "controller reconnected: $(state)"

got=$(dd if="$dev" bs=1M skip=3 count=8 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1)
[ "$got" = "$want" ] || fail "data after restart differs: $got != $want"
[ "$(range 256)" = "$want_fua" ] || fail "the FUA write did not survive the crash"
[ "$(range 384)" = "$zeros" ] || fail "the plain write survived the crash: the cache did not lose it"
step nvme disconnect -n "$TARGET_NQN"
log "PASS: data written before the crash was read back after the restart"
log "PASS: the FUA write survived the crash and the plain one did not"
