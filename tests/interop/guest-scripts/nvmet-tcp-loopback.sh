#!/bin/sh
# Kernel NVMe/TCP target and kernel NVMe/TCP host in the same guest, over 127.0.0.1:
# configfs target setup, nvme discover / connect / list / id-ctrl, fio verify, disconnect;
# once without digests and once with header and data digests.
#
#   tests/interop/guest.sh run --with-fio tests/interop/guest-scripts/nvmet-tcp-loopback.sh
#
# Environment (all optional): NVMET_PORT, NVMET_NQN, NVMET_NS_COUNT, NVMET_NS_SIZE_MB,
# NVMET_BACKEND (file|brd|null_blk), NVMET_TRADDR (default 127.0.0.1) -- see nvmet_from_env in
# /usr/lib/interop/interop.sh; FIO_SIZE (default 8M); FIO_BW=1 also measures sequential
# throughput.
# shellcheck source=../guest-lib/interop.sh
. /usr/lib/interop/interop.sh

: "${NVMET_TRADDR:=127.0.0.1}" "${NVMET_PORT:=4420}" "${FIO_SIZE:=8M}"
: "${NVMET_NQN:=nqn.2014-08.org.nvmexpress:nvmf-interop}"
export NVMET_TRADDR NVMET_PORT NVMET_NQN

nvmet_from_env

out=$(nvme discover -t tcp -a "$NVMET_TRADDR" -s "$NVMET_PORT") || fail "nvme discover failed"
echo "$out"
expect_contains "$out" "subnqn:  $NVMET_NQN" "discovery log page"
expect_contains "$out" "trsvcid: $NVMET_PORT" "discovery log page"

for digests in none hdr+data; do
    log "=== connect (digests: $digests)"
    set -- -t tcp -a "$NVMET_TRADDR" -s "$NVMET_PORT" -n "$NVMET_NQN"
    [ "$digests" = none ] || set -- "$@" --hdr-digest --data-digest
    step nvme connect "$@"
    dev=$(nvme_wait_ns "$NVMET_NQN" 1) || fail "namespace 1 of $NVMET_NQN did not appear"
    ctrl=$(nvme_ctrl_for "$NVMET_NQN")
    [ -n "$ctrl" ] || fail "no controller for $NVMET_NQN"
    log "controller $ctrl, namespace $dev, address $(cat "/sys/class/nvme/$ctrl/address")"

    out=$(nvme list) || fail "nvme list failed"
    echo "$out"
    expect_contains "$out" "$dev" "nvme list"

    out=$(nvme id-ctrl "/dev/$ctrl") || fail "nvme id-ctrl failed"
    echo "$out" | grep -E '^(vid|sn|mn|fr|cntlid|ver|mdts|kas|sgls|ioccsz|iorcsz|maxcmd|nn|cntrltype|subnqn|msdbd) '
    expect_contains "$out" "$NVMET_NQN" "id-ctrl subnqn"

    out=$(nvme id-ns "$dev") || fail "nvme id-ns failed"
    echo "$out" | grep -E '^(nsze|ncap|nuse|flbas|in use)|^lbaf .*in use'

    fio_verify "$dev" "$FIO_SIZE"
    if [ "${FIO_BW:-0}" = 1 ]; then
        fio_throughput "$dev" write 32M 128k 8
        fio_throughput "$dev" read 32M 128k 8
        fio_throughput "$dev" randread 16M 4k 16
    fi

    step nvme disconnect -n "$NVMET_NQN"
    [ -z "$(nvme_ctrl_for "$NVMET_NQN")" ] || fail "controller still present after disconnect"
done

nvmet_clear
log "PASS: kernel NVMe/TCP host <-> kernel target over $NVMET_TRADDR:$NVMET_PORT"
