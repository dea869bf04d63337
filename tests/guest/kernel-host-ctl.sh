#!/bin/sh
# Live changes to nvmeof-targetd seen by the Linux kernel host, without a reconnect. The test
# (tests/tests/kernel_host_ctl.rs) changes the target through `nvmeof-targetd ctl` each time
# this script prints "STEP <name>"; meanwhile fio with verify runs on namespace 1:
#   STEP add       the test adds namespace 2: its block device appears;
#   STEP resize    the test grows namespace 2: the block device takes the new size;
#   STEP remove    the test removes namespace 2: the block device goes;
#   STEP unhost    (after fio passed, with a persistent discovery controller connected) the
#                  test removes this host from the allowed list: the controller is
#                  disconnected and, refused on reconnect, deleted.
# The controller stays the same one throughout the namespace changes.
#
# Environment: TARGET_PORT, TARGET_NQN, HOST_NQN, NS2_BYTES, NS2_RESIZED_BYTES (required).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}" "${FIO_SIZE:=16M}"
[ -n "$TARGET_PORT" ] && [ -n "$TARGET_NQN" ] && [ -n "$HOST_NQN" ] ||
    fail "TARGET_PORT, TARGET_NQN and HOST_NQN are required"

step nvme connect -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN" \
    --hostnqn="$HOST_NQN" --reconnect-delay=1 --ctrl-loss-tmo=3
dev1=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
ctrl=$(nvme_ctrl_for "$TARGET_NQN")
cntlid=$(cat "/sys/class/nvme/$ctrl/cntlid")
log "controller $ctrl (cntlid $cntlid), namespace 1 at $dev1"
out=$(nvme id-ctrl "/dev/$ctrl") || fail "nvme id-ctrl failed"
echo "$out" | grep -E '^oaes '
echo "$out" | grep -qE '^oaes +: 0x900$' || fail "id-ctrl: OAES does not advertise namespace attribute and ANA change notices"

# fio with verify on namespace 1, round after round, through all the namespace changes.
(
    n=0
    while [ ! -e /tmp/fio.stop ]; do
        fio_verify "$dev1" "$FIO_SIZE" >/tmp/fio.out 2>&1 || exit 1
        n=$((n + 1))
        echo "$n" >/tmp/fio.rounds
    done
) &
fio_pid=$!

same_controller() {
    [ "$(nvme_ctrl_for "$TARGET_NQN")" = "$ctrl" ] && [ "$(cat "/sys/class/nvme/$ctrl/cntlid")" = "$cntlid" ] ||
        fail "the controller changed: the host reconnected"
}
bytes() { echo $(($(cat "/sys/block/${1#/dev/}/size") * 512)); }

echo "STEP add"
dev2=$(nvme_wait_ns "$TARGET_NQN" 2 60) || fail "namespace 2 did not appear"
same_controller
[ "$(bytes "$dev2")" = "$NS2_BYTES" ] || fail "namespace 2 is $(bytes "$dev2") bytes, not $NS2_BYTES"
log "PASS: namespace 2 appeared at $dev2 ($(bytes "$dev2") bytes) without a reconnect"
step dd if=/dev/urandom of="$dev2" bs=64k count=4 oflag=direct

echo "STEP resize"
i=0
while [ "$(bytes "$dev2")" != "$NS2_RESIZED_BYTES" ]; do
    i=$((i + 1)); [ $i -lt 600 ] || fail "namespace 2 stayed $(bytes "$dev2") bytes"
    sleep 0.1
done
same_controller
log "PASS: namespace 2 grew to $(bytes "$dev2") bytes"

echo "STEP remove"
i=0
while [ -b "$dev2" ]; do
    i=$((i + 1)); [ $i -lt 600 ] || fail "$dev2 did not go away"
    sleep 0.1
done
same_controller
log "PASS: namespace 2 went away"

touch /tmp/fio.stop
wait "$fio_pid" || { cat /tmp/fio.out; fail "fio with verify on $dev1 failed during the changes"; }
cat /tmp/fio.out
rounds=$(cat /tmp/fio.rounds 2>/dev/null || echo 0)
[ "$rounds" -ge 1 ] || fail "fio finished only $rounds round(s)"
log "PASS: fio with verify on namespace 1 ran $rounds rounds without errors through the changes"

# A persistent discovery controller: removing the host changes its discovery log, and the
# target raises a Discovery Log Page Change event on it (the test checks the target's log).
out=$(nvme discover -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" --hostnqn="$HOST_NQN" --persistent) ||
    fail "nvme discover --persistent failed"
expect_contains "$out" "subnqn:  $TARGET_NQN" "discovery log page"

echo "STEP unhost"
i=0
while [ -n "$(nvme_ctrl_for "$TARGET_NQN")" ] && [ "$(cat "/sys/class/nvme/$ctrl/state" 2>/dev/null)" = live ]; do
    i=$((i + 1)); [ $i -lt 600 ] || fail "the controller stayed live after its host was removed"
    sleep 0.1
done
log "controller state after the host was removed: $(cat "/sys/class/nvme/$ctrl/state" 2>/dev/null || echo deleted)"
i=0
while [ -n "$(nvme_ctrl_for "$TARGET_NQN")" ]; do
    i=$((i + 1)); [ $i -lt 300 ] || fail "the controller was not deleted (reconnects refused?)"
    sleep 0.1
done
[ ! -b "$dev1" ] || fail "$dev1 is still there"
log "PASS: the removed host was disconnected and could not reconnect"
