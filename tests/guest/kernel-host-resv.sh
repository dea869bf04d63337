#!/bin/sh
# NVMe reservations from the Linux kernel host with nvme-cli: two controllers of one subsystem
# with different host NQNs and host IDs (two hosts, as a two-node cluster sees them), native
# multipath off so each has its own block device. Host A registers and takes Write Exclusive;
# host B's writes (fio, dd) fail with Reservation Conflict while its reads work; B preempts
# and aborts A's reservation for Exclusive Access and A can no longer read; B releases. With
# Persist Through Power Loss on, B's reservation survives the test killing and restarting the
# target (it acts when this script prints "STEP kill"), then B clears everything.
#
# Environment: PORT_A, PORT_B (the target's two listeners), TARGET_NQN, HOST_A, HOSTID_A,
# HOST_B, HOSTID_B (required).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}" "${FIO_SIZE:=4M}"
[ -n "$PORT_A" ] && [ -n "$PORT_B" ] && [ -n "$TARGET_NQN" ] && [ -n "$HOST_A" ] && [ -n "$HOSTID_A" ] &&
    [ -n "$HOST_B" ] && [ -n "$HOSTID_B" ] ||
    fail "PORT_A, PORT_B, TARGET_NQN, HOST_A, HOSTID_A, HOST_B and HOSTID_B are required"
# Native multipath off (each controller its own block device): the boot modules were loaded
# without parameters, so nvme_core and the host modules above it are loaded again.
if [ "$(cat /sys/module/nvme_core/parameters/multipath)" != N ]; then
    i=0
    while grep -q '^nvme_core ' /proc/modules; do
        for m in $(awk '$1 ~ /^nvme/ && $1 !~ /^nvmet/ && $3 == 0 {print $1}' /proc/modules); do
            rmmod "$m" 2>/dev/null
        done
        i=$((i + 1)); [ $i -lt 20 ] || fail "cannot unload nvme_core: $(grep nvme /proc/modules)"
    done
    while read -r mod; do
        name=$(basename "$mod" .ko | tr - _)
        case "$name" in
        nvmet*) continue ;;
        nvme_core) step insmod "/lib/modules/$(uname -r)/$mod" multipath=N ;;
        nvme*) grep -q "^$name " /proc/modules || step insmod "/lib/modules/$(uname -r)/$mod" ;;
        esac
    done </etc/interop/modules.boot
fi
[ "$(cat /sys/module/nvme_core/parameters/multipath)" = N ] || fail "native NVMe multipath is on"

# Each host through its own listener (nvme-cli refuses a second connection to one address).
for h in A B; do
    eval "nqn=\$HOST_$h id=\$HOSTID_$h port=\$PORT_$h"
    step nvme connect -t tcp -a "$TARGET_ADDR" -s "$port" -n "$TARGET_NQN" \
        --hostnqn="$nqn" --hostid="$id" --reconnect-delay=1 --ctrl-loss-tmo=120
done
# ctrl_of HOSTNQN: the controller that host NQN opened.
ctrl_of() {
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$TARGET_NQN" ] &&
            [ "$(cat "$c/hostnqn" 2>/dev/null)" = "$1" ] && basename "$c"
    done
    return 0
}
# dev_of CTRL: the block device of namespace 1 of CTRL.
dev_of() {
    i=0
    while [ $i -lt 200 ]; do
        for n in /sys/class/nvme/"$1"/nvme*n1; do
            [ -b "/dev/$(basename "$n")" ] && { echo "/dev/$(basename "$n")"; return 0; }
        done
        i=$((i + 1)); sleep 0.1
    done
    return 1
}
ca=$(ctrl_of "$HOST_A"); cb=$(ctrl_of "$HOST_B")
[ -n "$ca" ] && [ -n "$cb" ] || fail "no controller for each host"
da=$(dev_of "$ca") || fail "no block device on $ca"
db=$(dev_of "$cb") || fail "no block device on $cb"
log "host A: $ca $da (cntlid $(cat /sys/class/nvme/"$ca"/cntlid)); host B: $cb $db (cntlid $(cat /sys/class/nvme/"$cb"/cntlid))"

out=$(nvme id-ctrl "/dev/$ca") || fail "nvme id-ctrl failed"
echo "$out" | grep -E '^oncs '
oncs=$(echo "$out" | sed -n 's/^oncs *: *//p')
[ $((oncs & 0x20)) -ne 0 ] || fail "id-ctrl: ONCS does not advertise reservations"
out=$(nvme id-ns "$da") || fail "nvme id-ns failed"
echo "$out" | grep -E '^rescap '
echo "$out" | grep -qE '^rescap +: 0xff$' || fail "id-ns: RESCAP is not 0xff"

# nvme-cli before 2.5 has no --eds: the extended structure is CDW11 bit 0.
eds=--eds
nvme resv-report --help 2>&1 | grep -q -- '--eds' || eds=--cdw11=1
# can_write DEV / can_read DEV: one direct 4 KiB write / read at block 0.
can_write() { dd if=/dev/zero of="$1" bs=4k count=1 oflag=direct 2>/tmp/dd.err; }
can_read() { dd if="$1" of=/dev/null bs=4k count=1 iflag=direct 2>/tmp/dd.err; }
report() {
    out=$(nvme resv-report "$1" $eds 2>&1) || fail "nvme resv-report $1 $eds failed: $out"
    echo "$out" | grep -E '^(gen|rtype|regctl|ptpls) '
    echo "$out" | grep -qE "^rtype +: $2\$" || fail "resv-report: rtype is not $2: $out"
    echo "$out" | grep -qE "^regctl +: $3\$" || fail "resv-report: regctl is not $3: $out"
}

step nvme resv-register "$da" --nrkey=0xa1 --rrega=0
step nvme resv-register "$db" --nrkey=0xb2 --rrega=0
step nvme resv-acquire "$da" --crkey=0xa1 --rtype=1 --racqa=0
report "$db" 1 2
if out=$(nvme resv-report "$db" 2>&1); then
    fail "resv-report without the extended structure succeeded: $out"
fi
log "resv-report without the extended structure refused: $out"
log "PASS: two hosts registered, host A holds Write Exclusive"

fio_verify "$da" "$FIO_SIZE"
if out=$(fio --name=conflict --filename="$db" --ioengine=libaio --direct=1 --rw=randwrite \
    --bs=4k --iodepth=8 --size=1M 2>&1); then
    echo "$out"
    fail "fio wrote through host B under host A's Write Exclusive reservation"
fi
echo "$out" | grep -E 'err=' | head -3
can_read "$db" || fail "host B cannot read under Write Exclusive: $(cat /tmp/dd.err)"
log "PASS: fio on host A verified; host B's fio writes failed with a conflict, its reads work"

# Host B preempts host A (key 0xa1) and aborts its commands, taking Exclusive Access.
step nvme resv-acquire "$db" --crkey=0xb2 --prkey=0xa1 --rtype=2 --racqa=2
report "$db" 2 1
can_read "$da" && fail "host A still reads after preempt and abort"
log "host A's read: $(tail -n 1 /tmp/dd.err)"
can_write "$da" && fail "host A still writes after preempt and abort"
fio_verify "$db" "$FIO_SIZE"
log "PASS: preempt and abort: host A lost its registration and access, host B verified"

# Releasing the wrong type is refused; the held type is released.
nvme resv-release "$db" --crkey=0xb2 --rtype=1 --rrela=0 && fail "released the wrong type"
step nvme resv-release "$db" --crkey=0xb2 --rtype=2 --rrela=0
can_write "$da" || fail "host A cannot write after the release: $(cat /tmp/dd.err)"
log "PASS: released"

# Persist Through Power Loss: on, then Write Exclusive for host B, then the target is killed.
step nvme resv-register "$db" --crkey=0xb2 --nrkey=0xb2 --rrega=0 --cptpl=3
step nvme resv-acquire "$db" --crkey=0xb2 --rtype=1 --racqa=0
report "$da" 1 1
echo "STEP kill"
# The test kills the target (the host's controller leaves the live state) and starts it
# again: both controllers reconnect.
i=0
while [ "$(cat /sys/class/nvme/"$cb"/state)" = live ]; do
    i=$((i + 1)); [ $i -lt 600 ] || fail "the controller stayed live: the target was not killed"
    sleep 0.05
done
log "controller $cb: $(cat /sys/class/nvme/"$cb"/state)"
i=0
while [ "$(cat /sys/class/nvme/"$ca"/state)" != live ] || [ "$(cat /sys/class/nvme/"$cb"/state)" != live ]; do
    i=$((i + 1)); [ $i -lt 1200 ] || fail "the controllers did not reconnect"
    sleep 0.1
done
log "reconnected"
report "$da" 1 1
out=$(nvme resv-report "$da" $eds 2>&1)
echo "$out" | grep -qE '^ptpls +: 1$' || fail "PTPL is not on after the restart: $out"
can_write "$da" && fail "host A writes: the reservation did not survive the restart"
can_write "$db" || fail "host B cannot write after the restart: $(cat /tmp/dd.err)"
log "PASS: the reservation survived the target's kill and restart"

step nvme resv-release "$db" --crkey=0xb2 --rrela=1
report "$da" 0 0
can_write "$da" || fail "host A cannot write after the clear: $(cat /tmp/dd.err)"
log "PASS: cleared"
for c in "$ca" "$cb"; do step nvme disconnect -d "$c"; done
