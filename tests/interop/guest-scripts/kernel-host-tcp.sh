#!/bin/sh
# Kernel NVMe/TCP host against a target outside the guest (by default one listening on the
# host's 127.0.0.1, which the guest reaches as 10.0.2.2): nvme discover, connect, list,
# id-ctrl, id-ns, data check (fio verify with --with-fio, else a dd write/read-back), disconnect.
#
#   tests/interop/guest.sh run --with-fio --env TARGET_PORT=4420 \
#       --env TARGET_NQN=nqn.2014-08.org.nvmexpress:test tests/interop/guest-scripts/kernel-host-tcp.sh
#
# Environment: TARGET_NQN (required), TARGET_ADDR (10.0.2.2), TARGET_PORT (4420),
# DIGESTS (none|hdr|data|both, default none), NR_IO_QUEUES (kernel default if unset),
# EXPECT_NS (number of namespaces to expect, default 1), FIO_SIZE (8M), DISCOVER (1: also run
# nvme discover against the same port).
# shellcheck source=../guest-lib/interop.sh
. /usr/lib/interop/interop.sh

[ -n "${TARGET_NQN:-}" ] || fail "TARGET_NQN is not set"
: "${TARGET_ADDR:=10.0.2.2}" "${TARGET_PORT:=4420}" "${DIGESTS:=none}" "${EXPECT_NS:=1}"

if [ "${DISCOVER:-1}" = 1 ]; then
    out=$(nvme discover -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT") || fail "nvme discover failed"
    echo "$out"
    expect_contains "$out" "subnqn:  $TARGET_NQN" "discovery log page"
fi

set -- -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN"
case "$DIGESTS" in
none) ;;
hdr) set -- "$@" --hdr-digest ;;
data) set -- "$@" --data-digest ;;
both) set -- "$@" --hdr-digest --data-digest ;;
*) fail "DIGESTS must be none, hdr, data or both" ;;
esac
[ -z "${NR_IO_QUEUES:-}" ] || set -- "$@" --nr-io-queues="$NR_IO_QUEUES"
step nvme connect "$@"

ctrl=$(nvme_ctrl_for "$TARGET_NQN")
[ -n "$ctrl" ] || fail "no controller for $TARGET_NQN after connect"
log "controller $ctrl: $(cat "/sys/class/nvme/$ctrl/address"), state $(cat "/sys/class/nvme/$ctrl/state")"

out=$(nvme id-ctrl "/dev/$ctrl") || fail "nvme id-ctrl failed"
echo "$out" | grep -E '^(vid|sn|mn|fr|cntlid|ver|mdts|kas|sgls|ioccsz|iorcsz|maxcmd|nn|cntrltype|subnqn|msdbd) '
expect_contains "$out" "$TARGET_NQN" "id-ctrl subnqn"

nsid=1
while [ "$nsid" -le "$EXPECT_NS" ]; do
    dev=$(nvme_wait_ns "$TARGET_NQN" "$nsid") || fail "namespace $nsid did not appear"
    out=$(nvme id-ns "$dev") || fail "nvme id-ns $dev failed"
    echo "$dev: $(echo "$out" | grep -E '^(nsze|flbas)' | tr -s ' ' | tr '\n' ' ')"
    nsid=$((nsid + 1))
done
step nvme list

dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 did not appear"
if command -v fio >/dev/null; then
    fio_verify "$dev" "${FIO_SIZE:-8M}"
else
    step dd if=/dev/urandom of=/tmp/pattern bs=4096 count=256
    step dd if=/tmp/pattern of="$dev" bs=4096 count=256 oflag=direct
    step dd if="$dev" of=/tmp/readback bs=4096 count=256 iflag=direct
    [ "$(md5sum </tmp/pattern)" = "$(md5sum </tmp/readback)" ] || fail "data read back differs"
    log "1 MiB written and read back intact"
fi

step nvme disconnect -n "$TARGET_NQN"
[ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || fail "controller still present after disconnect"
log "PASS: kernel NVMe/TCP host against $TARGET_ADDR:$TARGET_PORT ($TARGET_NQN, digests $DIGESTS)"
