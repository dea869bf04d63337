#!/bin/sh
# Soft-RoCE (rdma_rxe) on the guest's eth0: `rdma link add`, the verbs device as seen by
# libibverbs, an RDMA-CM ping through the rxe loopback, and (unless ROCE_NVME=0) a kernel
# NVMe/RDMA host connected to the kernel NVMe/RDMA target over rxe with a fio verify when fio
# is present.
#
#   tests/interop/guest.sh run --with-rdma [--with-fio] tests/interop/guest-scripts/soft-roce.sh
#
# Environment: ROCE_NVME (1), NVMET_PORT (4420), NVMET_NQN, NVMET_NS_SIZE_MB, NVMET_BACKEND,
# FIO_SIZE (8M).
# shellcheck source=../guest-lib/interop.sh
. /usr/lib/interop/interop.sh

command -v rdma >/dev/null || fail "rdma tool missing (guest.sh --with-rdma)"

# rxe computes ICRCs with the kernel crypto "crc32"; load a provider first.
step modprobe crc32_generic
step modprobe rdma_rxe
step modprobe ib_uverbs
step modprobe rdma_ucm
step rdma link add rxe0 type rxe netdev eth0

out=$(rdma link) || fail "rdma link failed"
echo "$out"
expect_contains "$out" "rxe0" "rdma link"
expect_contains "$out" "netdev eth0" "rdma link"
i=0
until rdma link show rxe0/1 | grep -q 'state ACTIVE'; do
    i=$((i + 1))
    [ $i -lt 50 ] || fail "rxe0/1 did not become ACTIVE: $(rdma link show rxe0/1)"
    sleep 0.1
done
step rdma dev

out=$(ibv_devinfo -d rxe0) || fail "ibv_devinfo failed"
echo "$out" | grep -E 'hca_id|transport|node_guid|state|active_mtu|link_layer'
expect_contains "$out" "PORT_ACTIVE" "ibv_devinfo"

addr=${GUEST_IP:-10.0.2.15}
log "rping over rxe0 ($addr)"
rping -s -a "$addr" -C 3 -v >/tmp/rping-server.log 2>&1 &
server=$!
sleep 0.5
out=$(rping -c -a "$addr" -C 3 -v 2>&1) || {
    cat /tmp/rping-server.log
    fail "rping client failed: $out"
}
echo "$out"
wait "$server" || fail "rping server failed: $(cat /tmp/rping-server.log)"
expect_contains "$out" "ping data" "rping"

if [ "${ROCE_NVME:-1}" = 1 ]; then
    log "NVMe/RDMA: kernel host -> kernel target over rxe0"
    NVMET_TRTYPE=rdma
    NVMET_TRADDR=$addr
    : "${NVMET_PORT:=4420}" "${NVMET_NQN:=nqn.2014-08.org.nvmexpress:nvmf-rdma-interop}"
    nvmet_from_env
    step modprobe nvme_rdma
    out=$(nvme discover -t rdma -a "$addr" -s "$NVMET_PORT") || fail "nvme discover (rdma) failed"
    expect_contains "$out" "subnqn:  $NVMET_NQN" "discovery log page"
    step nvme connect -t rdma -a "$addr" -s "$NVMET_PORT" -n "$NVMET_NQN"
    dev=$(nvme_wait_ns "$NVMET_NQN" 1) || fail "namespace did not appear"
    ctrl=$(nvme_ctrl_for "$NVMET_NQN")
    log "controller $ctrl ($(cat "/sys/class/nvme/$ctrl/transport")), namespace $dev"
    step nvme list
    if command -v fio >/dev/null; then
        fio_verify "$dev" "${FIO_SIZE:-8M}"
    else
        step dd if=/dev/urandom of=/tmp/pattern bs=4096 count=64
        step dd if=/tmp/pattern of="$dev" bs=4096 count=64 oflag=direct
        step dd if="$dev" of=/tmp/readback bs=4096 count=64 iflag=direct
        [ "$(md5sum </tmp/pattern)" = "$(md5sum </tmp/readback)" ] || fail "read back differs"
        log "256 KiB written and read back intact"
    fi
    step nvme disconnect -n "$NVMET_NQN"
    nvmet_clear
fi

step rdma link delete rxe0
log "PASS: Soft-RoCE"
