#!/bin/sh
# Native NVMe multipath of the Linux 6.12 host over two nvmeof-targetd processes that serve one
# namespace from one shared file: path A (PORT_A) optimized, path B (PORT_B) non-optimized. fio
# with verify runs on the multipath device throughout, while the test
# (tests/tests/kernel_host_ana.rs) acts each time this script prints "STEP <name>":
#   STEP unmask        (before fio) namespace 2 of path A's target, masked from this host, is
#                      not in the active namespace list, is inactive (Identify) and has no
#                      block device; the test shows it to this host with `ctl ns-add-host`
#                      and its block device appears;
#   STEP inaccessible  `ctl set-ana-state` makes path A inaccessible: the host reads the new
#                      state (ANA change notice) and I/O goes through B;
#   STEP optimized     path A is optimized again;
#   STEP kill          the process behind path A is killed (SIGKILL): I/O fails over to B;
#   STEP restart       it is started again: the host reconnects and A is optimized again.
#
# Environment: TARGET_NQN, HOST_NQN, HOST_ID, PORT_A, PORT_B (required).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}" "${FIO_SIZE:=8M}"
[ -n "$TARGET_NQN" ] && [ -n "$HOST_NQN" ] && [ -n "$HOST_ID" ] && [ -n "$PORT_A" ] &&
    [ -n "$PORT_B" ] || fail "TARGET_NQN, HOST_NQN, HOST_ID, PORT_A and PORT_B are required"
[ "$(cat /sys/module/nvme_core/parameters/multipath)" = Y ] || fail "native NVMe multipath is off"

# ctrl_on PORT: the controller connected to PORT.
ctrl_on() {
    for c in /sys/class/nvme/nvme*; do
        case "$(cat "$c/address" 2>/dev/null)" in
        *"trsvcid=$1,"* | *"trsvcid=$1") basename "$c" ;;
        esac
    done
    return 0
}
# ana_on PORT: the ANA state of namespace 1 through the controller on PORT.
ana_on() {
    c=$(ctrl_on "$1")
    [ -n "$c" ] || return 0
    for n in /sys/class/nvme/"$c"/nvme*c*n*; do
        [ "$(cat "$n/nsid" 2>/dev/null)" = 1 ] && cat "$n/ana_state"
    done
    return 0
}
# wait_ana PORT STATE [TIMEOUT_S]
wait_ana() {
    i=0
    while [ "$(ana_on "$1")" != "$2" ]; do
        i=$((i + 1)); [ $i -lt $((${3:-60} * 10)) ] || fail "path on port $1 is '$(ana_on "$1")', not $2"
        sleep 0.1
    done
    log "path on port $1 ($(ctrl_on "$1")): $2"
}
# wait_rounds: waits until fio finishes one more round with verify (I/O flows).
wait_rounds() {
    before=$(cat /tmp/fio.rounds 2>/dev/null || echo 0)
    i=0
    while [ "$(cat /tmp/fio.rounds 2>/dev/null || echo 0)" -le "$before" ]; do
        kill -0 "$fio_pid" 2>/dev/null || { cat /tmp/fio.out; fail "fio with verify failed"; }
        i=$((i + 1)); [ $i -lt 3000 ] || fail "fio made no progress in 300 s"
        sleep 0.1
    done
}
# subsys: `nvme list-subsys` of the multipath device, which shows each path's ANA state.
subsys() {
    out=$(nvme list-subsys "$dev" 2>&1) || fail "nvme list-subsys $dev failed: $out"
    echo "$out"
}

for p in "$PORT_A" "$PORT_B"; do
    step nvme connect -t tcp -a "$TARGET_ADDR" -s "$p" -n "$TARGET_NQN" --hostnqn="$HOST_NQN" \
        --hostid="$HOST_ID" --reconnect-delay=1 --ctrl-loss-tmo=120
done
dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
ca=$(ctrl_on "$PORT_A")
cb=$(ctrl_on "$PORT_B")
[ -n "$ca" ] && [ -n "$cb" ] || fail "no controller on each path"
log "multipath device $dev: path A $ca (cntlid $(cat /sys/class/nvme/"$ca"/cntlid)), path B $cb (cntlid $(cat /sys/class/nvme/"$cb"/cntlid))"
[ "$(cat /sys/class/nvme/"$ca"/subsysnqn)" = "$TARGET_NQN" ] || fail "path A: wrong subsystem"
out=$(nvme id-ctrl "/dev/$ca") || fail "nvme id-ctrl failed"
echo "$out" | grep -E '^(cmic|anatt|anacap|anagrpmax|nanagrpid) '
echo "$out" | grep -qE '^cmic +: 0xa$' || fail "id-ctrl: CMIC does not report ANA"
wait_ana "$PORT_A" optimized
wait_ana "$PORT_B" non-optimized
out=$(subsys)
echo "$out"
expect_contains "$out" "live optimized" "nvme list-subsys"
expect_contains "$out" "live non-optimized" "nvme list-subsys"
log "PASS: one multipath device over two target processes, paths optimized and non-optimized"

# Namespace 2 (path A's target only) is masked from this host.
out=$(nvme list 2>&1)
echo "$out"
! nvme_wait_ns "$TARGET_NQN" 2 2 >/dev/null || fail "masked namespace 2 is visible"
out=$(nvme list-ns "/dev/$ca") || fail "nvme list-ns failed"
echo "$out"
case "$out" in *":0x2"*) fail "masked namespace 2 is in the active namespace list" ;; esac
out=$(nvme id-ns "/dev/$ca" --namespace-id=2) || fail "nvme id-ns --namespace-id=2 failed"
echo "$out" | grep -E '^(nsze|ncap|anagrpid) '
echo "$out" | grep -qE '^nsze +: 0$' || fail "masked namespace 2 is not inactive"
log "PASS: namespace 2 masked from this host: not listed, inactive, no block device"
echo "STEP unmask"
dev2=$(nvme_wait_ns "$TARGET_NQN" 2 60) || fail "namespace 2 did not appear once shown to this host"
step dd if="$dev2" of=/dev/null bs=64k count=4 iflag=direct
log "PASS: namespace 2 appeared at $dev2 once shown to this host"

(
    n=0
    while [ ! -e /tmp/fio.stop ]; do
        fio_verify "$dev" "$FIO_SIZE" >/tmp/fio.out 2>&1 || exit 1
        n=$((n + 1))
        echo "$n" >/tmp/fio.rounds
    done
) &
fio_pid=$!
wait_rounds

echo "STEP inaccessible"
wait_ana "$PORT_A" inaccessible
out=$(subsys)
echo "$out"
expect_contains "$out" "live inaccessible" "nvme list-subsys"
wait_rounds
log "PASS: path A inaccessible by ctl set-ana-state, fio with verify went on through path B"

echo "STEP optimized"
wait_ana "$PORT_A" optimized
wait_rounds
log "PASS: path A optimized again"

echo "STEP kill"
i=0
while [ "$(cat /sys/class/nvme/"$ca"/state 2>/dev/null)" = live ]; do
    i=$((i + 1)); [ $i -lt 600 ] || fail "path A stayed live after its target was killed"
    sleep 0.1
done
log "path A after its target was killed: $(cat /sys/class/nvme/"$ca"/state 2>/dev/null)"
wait_rounds
log "PASS: fio with verify went on through path B while the target of path A was down"

echo "STEP restart"
i=0
while [ "$(cat /sys/class/nvme/"$ca"/state 2>/dev/null)" != live ]; do
    i=$((i + 1)); [ $i -lt 1200 ] || fail "path A did not reconnect"
    sleep 0.1
done
wait_ana "$PORT_A" optimized
wait_rounds
out=$(subsys)
echo "$out"
expect_contains "$out" "live optimized" "nvme list-subsys"
log "PASS: path A reconnected to the restarted target and is optimized"

touch /tmp/fio.stop
wait "$fio_pid" || { cat /tmp/fio.out; fail "fio with verify failed"; }
cat /tmp/fio.out
log "PASS: fio with verify ran $(cat /tmp/fio.rounds) rounds without errors through every path change"
