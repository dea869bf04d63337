#!/bin/sh
# The Linux kernel NVMe/RDMA host (nvme-rdma over Soft-RoCE) against nvmeof-targetd, both in
# the guest: rxe0 on eth0, the target on rdma://GUEST_IP:TARGET_PORT, then discovery, connect
# with several I/O queues, Identify (keyed SGLs advertised), fio with verify (4k and 128k
# random writes, iodepth 16), flush, discard and write zeroes, disconnect, an RDMA listener
# added and removed while the target runs (nvmeof-targetd ctl), and a clean SIGTERM shutdown
# of the target. Run by tests/tests/kernel_host_rdma.rs; also by hand:
#   cargo build -p nvmeof-target --bins
#   tests/interop/guest.sh run --with-rdma --with-fio \
#       --add-bin target/debug/nvmeof-targetd:/usr/bin/nvmeof-targetd tests/guest/kernel-host-rdma.sh
#
# Environment: TARGET_NQN, TARGET_PORT (4420), NS (mem:256M), QUEUES (2), FIO_SIZE (8M),
# TARGETD (/usr/bin/nvmeof-targetd), LOOPBACK (/usr/bin/nvmf-rdma-loopback: run first if present,
# from target/debug/examples/loopback).
# shellcheck source=../interop/guest-lib/interop.sh
. /usr/lib/interop/interop.sh

: "${TARGET_NQN:=nqn.2026-11.io.nvmeof-direct:rdma}" "${TARGET_PORT:=4420}" "${NS:=mem:256M}"
: "${QUEUES:=2}" "${FIO_SIZE:=8M}" "${TARGETD:=/usr/bin/nvmeof-targetd}"
: "${LOOPBACK:=/usr/bin/nvmf-rdma-loopback}"
addr=${GUEST_IP:-10.0.2.15}
tlog=/tmp/nvmeof-targetd.log

[ -x "$TARGETD" ] || fail "$TARGETD missing (guest.sh --add-bin target/debug/nvmeof-targetd:$TARGETD)"
command -v rdma >/dev/null || fail "rdma tool missing (guest.sh --with-rdma)"

show_target_log() {
    echo "----- nvmeof-targetd log -----"
    cat "$tlog"
    echo "----- end of nvmeof-targetd log -----"
}
die() {
    show_target_log
    fail "$*"
}

# Soft-RoCE on eth0 (rxe needs a crc32 crypto provider first).
step modprobe crc32_generic
step modprobe rdma_rxe
step modprobe ib_uverbs
step modprobe rdma_ucm
step rdma link add rxe0 type rxe netdev eth0
i=0
until rdma link show rxe0/1 | grep -q 'state ACTIVE'; do
    i=$((i + 1))
    [ $i -lt 50 ] || fail "rxe0/1 did not become ACTIVE: $(rdma link show rxe0/1)"
    sleep 0.1
done
log "rxe0 ACTIVE on eth0 ($addr)"

# The verbs layer on its own first: nvmf-rdma's loopback example (connect, reject, SEND/RECV,
# RDMA READ/WRITE of registered memory), when the test copied it in.
if [ -x "$LOOPBACK" ]; then
    step "$LOOPBACK" "$addr:$((TARGET_PORT + 1))"
fi

log "starting nvmeof-targetd on rdma://$addr:$TARGET_PORT"
sock=/tmp/nvmeof-targetd.sock
NVMEOF_LOG=${NVMEOF_LOG:-debug} "$TARGETD" --listen "rdma://$addr:$TARGET_PORT" \
    --subsystem "$TARGET_NQN" --namespace "$NS" --reactors 2 --control-socket "$sock" \
    >"$tlog" 2>&1 &
tpid=$!
i=0
until grep -q "nvmeof-targetd ready" "$tlog"; do
    i=$((i + 1))
    kill -0 "$tpid" 2>/dev/null || die "nvmeof-targetd exited during start"
    [ $i -lt 300 ] || die "nvmeof-targetd did not become ready"
    sleep 0.1
done
log "nvmeof-targetd ready (pid $tpid)"

fio_job() { # DEV BS RW IODEPTH NUMJOBS SIZE
    echo "+ fio $3 bs=$2 iodepth=$4 numjobs=$5 size=$6 verify=crc32c on $1"
    if ! out=$(fio --name=verify --filename="$1" --ioengine=libaio --direct=1 --rw="$3" \
        --bs="$2" --iodepth="$4" --numjobs="$5" --offset_increment="$6" --size="$6" \
        --verify=crc32c --do_verify=1 --verify_fatal=1 --randrepeat=0 --group_reporting 2>&1); then
        echo "$out"
        die "fio $3 bs=$2 on $1 failed"
    fi
    echo "$out" | grep -E 'err=|^ +(read|write): IOPS|^ +(READ|WRITE):'
    expect_contains "$out" "err= 0" "fio result"
}

step modprobe nvme_rdma

out=$(nvme discover -t rdma -a "$addr" -s "$TARGET_PORT") || die "nvme discover (rdma) failed: $out"
echo "$out"
expect_contains "$out" "trtype:  rdma" "discovery log page"
expect_contains "$out" "subnqn:  $TARGET_NQN" "discovery log page"
expect_contains "$out" "trsvcid: $TARGET_PORT" "discovery log page"
expect_contains "$out" "traddr:  $addr" "discovery log page"
expect_contains "$out" "subtype: current discovery subsystem" "discovery log page"

log "=== connect ($QUEUES I/O queues)"
nvme connect -t rdma -a "$addr" -s "$TARGET_PORT" -n "$TARGET_NQN" --nr-io-queues="$QUEUES" \
    || die "nvme connect -t rdma failed"
dev=$(nvme_wait_ns "$TARGET_NQN" 1) || die "namespace 1 of $TARGET_NQN did not appear"
ctrl=$(nvme_ctrl_for "$TARGET_NQN")
[ -n "$ctrl" ] || die "no controller for $TARGET_NQN"
transport=$(cat "/sys/class/nvme/$ctrl/transport")
log "controller $ctrl ($transport), namespace $dev, address $(cat "/sys/class/nvme/$ctrl/address")"
[ "$transport" = rdma ] || die "controller transport is $transport"
nq=$(cat "/sys/class/nvme/$ctrl/queue_count")
log "queues (admin + I/O): $nq"
[ "$nq" -eq $((QUEUES + 1)) ] || die "expected $QUEUES I/O queues, found $((nq - 1))"

out=$(nvme list) || die "nvme list failed"
echo "$out"
expect_contains "$out" "$dev" "nvme list"
expect_contains "$out" "nvmeof-direct" "nvme list model"

out=$(nvme id-ctrl "/dev/$ctrl") || die "nvme id-ctrl failed"
echo "$out" | grep -E '^(sn|mn|cntlid|ver|mdts|kas|sgls|ioccsz|iorcsz|maxcmd|nn|oncs|vwc|cntrltype|subnqn|msdbd) '
expect_contains "$out" "$TARGET_NQN" "id-ctrl subnqn"
sgls=$(echo "$out" | sed -n 's/^sgls *: *//p')
[ $((sgls & 4)) -ne 0 ] || die "keyed SGL data blocks not advertised (sgls $sgls)"

out=$(nvme id-ns "$dev") || die "nvme id-ns failed"
echo "$out" | grep -E '^(nsze|ncap|nuse)|^lbaf .*in use'
out=$(nvme smart-log "/dev/$ctrl") || die "nvme smart-log failed"
echo "$out" | grep -E '^(host_read_commands|host_write_commands|data_units)'

fio_job "$dev" 4k randwrite 16 2 "$FIO_SIZE"
fio_job "$dev" 128k randwrite 16 2 "$FIO_SIZE"
# A transfer larger than the in-capsule size and one that spans many pages.
step dd if=/dev/urandom of=/tmp/pattern bs=1M count=4
step dd if=/tmp/pattern of="$dev" bs=1M seek=1 oflag=direct
step dd if="$dev" of=/tmp/readback bs=1M skip=1 count=4 iflag=direct
[ "$(md5sum </tmp/pattern)" = "$(md5sum </tmp/readback)" ] || die "1 MiB transfers read back differently"
step nvme flush "$dev"
step blkdiscard -o 0 -l 1048576 "$dev"
z=$(dd if="$dev" bs=4096 count=256 iflag=direct 2>/dev/null | tr -d '\000' | wc -c)
[ "$z" -eq 0 ] || die "discarded range does not read back as zeros ($z nonzero bytes)"
step nvme write-zeroes "$dev" -s 512 -c 63

step nvme disconnect -n "$TARGET_NQN"
[ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || die "controller still present after disconnect"

# An RDMA listener added and removed while the target runs, as NVMe/TCP ones are.
live=$((TARGET_PORT + 2))
step "$TARGETD" ctl --socket "$sock" add-listener "rdma://$addr:$live"
out=$(nvme discover -t rdma -a "$addr" -s "$live") || die "nvme discover on the added listener failed: $out"
expect_contains "$out" "trsvcid: $live" "discovery log page through the added listener"
step "$TARGETD" ctl --socket "$sock" remove-listener "rdma://$addr:$live"
i=0
while nvme discover -t rdma -a "$addr" -s "$live" >/dev/null 2>&1; do
    i=$((i + 1))
    [ $i -lt 50 ] || die "the removed RDMA listener still answers"
    sleep 0.1
done
log "RDMA listener rdma://$addr:$live added and removed live"

kill -TERM "$tpid"
i=0
while kill -0 "$tpid" 2>/dev/null; do
    i=$((i + 1))
    [ $i -lt 300 ] || die "nvmeof-targetd did not exit after SIGTERM"
    sleep 0.1
done
wait "$tpid"
rc=$?
show_target_log
[ "$rc" -eq 0 ] || fail "nvmeof-targetd exited with $rc"
step rdma link delete rxe0
log "PASS: kernel NVMe/RDMA host <-> nvmeof-targetd on rdma://$addr:$TARGET_PORT"
