#!/bin/sh
# The Linux kernel NVMe/TCP host (nvme-cli, nvme-tcp, fio) against nvmeof-targetd running on the
# host's loopback (10.0.2.2 from the guest). Run by tests/tests/kernel_host.rs through
# tests/interop/guest.sh; also by hand:
#   tests/interop/guest.sh run --with-fio --env TARGET_PORT=4420 \
#       --env TARGET_NQN=nqn.2026-11.io.nvmeof-direct:default tests/guest/kernel-host-tcp.sh
#
# Environment: TARGET_PORT, TARGET_NQN (required); FIO_SIZE (default 8M); QUEUES (default 2).
. /usr/lib/interop/interop.sh

: "${TARGET_ADDR:=10.0.2.2}" "${FIO_SIZE:=8M}" "${QUEUES:=2}"
[ -n "$TARGET_PORT" ] && [ -n "$TARGET_NQN" ] || fail "TARGET_PORT and TARGET_NQN are required"

fio_job() { # DEV BS RW IODEPTH NUMJOBS SIZE
    echo "+ fio $3 bs=$2 iodepth=$4 numjobs=$5 size=$6 verify=crc32c on $1"
    if ! out=$(fio --name=verify --filename="$1" --ioengine=libaio --direct=1 --rw="$3" \
        --bs="$2" --iodepth="$4" --numjobs="$5" --offset_increment="$6" --size="$6" \
        --verify=crc32c --do_verify=1 --verify_fatal=1 --randrepeat=0 --group_reporting 2>&1); then
        echo "$out"
        fail "fio $3 bs=$2 on $1 failed"
    fi
    echo "$out" | grep -E 'err=|^ +(read|write): IOPS|^ +(READ|WRITE):'
    expect_contains "$out" "err= 0" "fio result"
}

out=$(nvme discover -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT") || fail "nvme discover failed"
echo "$out"
expect_contains "$out" "subnqn:  $TARGET_NQN" "discovery log page"
expect_contains "$out" "trsvcid: $TARGET_PORT" "discovery log page"
expect_contains "$out" "subtype: current discovery subsystem" "discovery log page"

for digests in none hdr+data; do
    log "=== connect (digests: $digests, $QUEUES I/O queues)"
    set -- -t tcp -a "$TARGET_ADDR" -s "$TARGET_PORT" -n "$TARGET_NQN" --nr-io-queues="$QUEUES"
    [ "$digests" = none ] || set -- "$@" --hdr-digest --data-digest
    step nvme connect "$@"
    dev=$(nvme_wait_ns "$TARGET_NQN" 1) || fail "namespace 1 of $TARGET_NQN did not appear"
    ctrl=$(nvme_ctrl_for "$TARGET_NQN")
    [ -n "$ctrl" ] || fail "no controller for $TARGET_NQN"
    log "controller $ctrl, namespace $dev, address $(cat "/sys/class/nvme/$ctrl/address")"
    nq=$(cat "/sys/class/nvme/$ctrl/queue_count")
    log "queues (admin + I/O): $nq"
    [ "$nq" -eq $((QUEUES + 1)) ] || fail "expected $QUEUES I/O queues, found $((nq - 1))"

    out=$(nvme list) || fail "nvme list failed"
    echo "$out"
    expect_contains "$out" "$dev" "nvme list"
    expect_contains "$out" "nvmeof-direct" "nvme list model"

    out=$(nvme id-ctrl "/dev/$ctrl") || fail "nvme id-ctrl failed"
    echo "$out" | grep -E '^(vid|sn|mn|fr|cntlid|ver|mdts|kas|sgls|ioccsz|iorcsz|maxcmd|nn|oncs|vwc|cntrltype|subnqn|msdbd) '
    expect_contains "$out" "$TARGET_NQN" "id-ctrl subnqn"

    out=$(nvme id-ns "$dev") || fail "nvme id-ns failed"
    echo "$out" | grep -E '^(nsze|ncap|nuse|nmic|dlfeat|nguid|eui64)|^lbaf .*in use'
    out=$(nvme ns-descs "$dev") || fail "nvme ns-descs failed"
    echo "$out"
    expect_contains "$out" "uuid" "namespace descriptors"
    out=$(nvme smart-log "/dev/$ctrl") || fail "nvme smart-log failed"
    echo "$out" | grep -E '^(host_read_commands|host_write_commands|data_units)'
    out=$(nvme error-log "/dev/$ctrl" -e 4) || fail "nvme error-log failed"

    fio_job "$dev" 4k randwrite 16 2 "$FIO_SIZE"
    fio_job "$dev" 128k randwrite 16 2 "$FIO_SIZE"
    step nvme flush "$dev"
    # Deallocate (discard) and write zeroes, then the blocks read back as zeros.
    step blkdiscard -o 0 -l 1048576 "$dev"
    z=$(dd if="$dev" bs=4096 count=256 iflag=direct 2>/dev/null | tr -d '\000' | wc -c)
    [ "$z" -eq 0 ] || fail "discarded range does not read back as zeros ($z nonzero bytes)"
    step nvme write-zeroes "$dev" -s 512 -c 63

    step nvme disconnect -n "$TARGET_NQN"
    [ -z "$(nvme_ctrl_for "$TARGET_NQN")" ] || fail "controller still present after disconnect"
done
log "PASS: kernel NVMe/TCP host <-> nvmeof-targetd on $TARGET_ADDR:$TARGET_PORT"
