#!/bin/sh
# QEMU's emulated NVMe PCIe controller (guest.sh --nvme-disk FILE): the kernel nvme driver sees
# it (nvme list, id-ctrl, a data round trip), then it is unbound and handed to vfio-pci behind
# the emulated Intel IOMMU, which is where a userspace NVMe driver takes over.
#
#   truncate -s 64M /tmp/nvme.img
#   tests/interop/guest.sh run --nvme-disk /tmp/nvme.img tests/interop/guest-scripts/nvme-pcie-vfio.sh
#
# Prints "VFIO-GROUP <pci address> /dev/vfio/<group>" whenever it binds the function to
# vfio-pci.
#
# With /usr/bin/nvme-pcie-probe present (crates/nvme-pcie's vfio_probe example, guest.sh
# --add-bin target/debug/examples/vfio_probe:/usr/bin/nvme-pcie-probe), the user-space driver
# then drives the controller through VFIO: it reads back the pattern the kernel wrote, writes
# and reads on two queue pairs and shuts the controller down. The function is then handed back
# to the kernel nvme driver, which reads what the probe wrote and compares it.
#
# With /usr/bin/nvmeof-targetd present (and fio: guest.sh --with-fio), the daemon must first
# refuse `--namespace pcie:ADDRESS` while the nvme driver holds the function; then, with the
# function on vfio-pci, it exports it over NVMe/TCP on 127.0.0.1 and the kernel's NVMe/TCP host
# runs a fio verify and a short throughput run through it. Environment: TARGET_PORT (4420),
# FIO_SIZE (4M).
#
# With /usr/bin/nvmeof-bench present, the load generator runs a short job over the function
# in its das and tcp (in-process target) modes, reads verified, and prints its table with the
# tcp/das ratio. Environment: BENCH_RUNTIME (1s).
# shellcheck source=../guest-lib/interop.sh
. /usr/lib/interop/interop.sh

step modprobe nvme
i=0
while [ ! -b /dev/nvme0n1 ] && [ $i -lt 100 ]; do
    sleep 0.1
    i=$((i + 1))
done
[ -b /dev/nvme0n1 ] || fail "no /dev/nvme0n1 (guest.sh --nvme-disk FILE given?)"
[ "$(cat /sys/class/nvme/nvme0/transport)" = pcie ] || fail "nvme0 is not a PCIe controller"
step nvme list
out=$(nvme id-ctrl /dev/nvme0) || fail "nvme id-ctrl failed"
echo "$out" | grep -E '^(vid|ssvid|sn|mn|fr|mdts|ver|nn|sqes|cqes) '

step dd if=/dev/urandom of=/tmp/pattern bs=4096 count=64
step dd if=/tmp/pattern of=/dev/nvme0n1 bs=4096 count=64 oflag=direct
step dd if=/dev/nvme0n1 of=/tmp/readback bs=4096 count=64 iflag=direct
cmp /tmp/pattern /tmp/readback || fail "data read back differs"

bdf=$(readlink /sys/class/nvme/nvme0/device)
bdf=${bdf##*/}
dev=/sys/bus/pci/devices/$bdf

# bind_vfio: hands the function from the nvme driver to vfio-pci.
bind_vfio() {
    [ -e /sys/kernel/iommu_groups/0 ] || fail "no IOMMU groups (intel_iommu=on missing?)"
    step modprobe vfio_pci
    step modprobe vfio_iommu_type1
    echo "$bdf" >"$dev/driver/unbind" || fail "cannot unbind $bdf from nvme"
    echo vfio-pci >"$dev/driver_override"
    echo "$bdf" >/sys/bus/pci/drivers_probe
    drv=$(readlink "$dev/driver")
    [ "${drv##*/}" = vfio-pci ] || fail "$bdf is bound to '${drv##*/}', not vfio-pci"
    group=$(readlink "$dev/iommu_group")
    group=${group##*/}
    [ -c "/dev/vfio/$group" ] || fail "/dev/vfio/$group missing"
    echo "VFIO-GROUP $bdf /dev/vfio/$group"
}

# bind_nvme: hands the function back to the nvme driver; sets blk to its namespace 1.
bind_nvme() {
    echo "$bdf" >/sys/bus/pci/drivers/vfio-pci/unbind || fail "cannot unbind $bdf from vfio-pci"
    echo >"$dev/driver_override"
    echo "$bdf" >/sys/bus/pci/drivers_probe
    blk=""
    i=0
    while [ -z "$blk" ] && [ $i -lt 100 ]; do
        for c in "$dev"/nvme/nvme*/nvme*n1; do
            [ -e "$c" ] && [ -b "/dev/${c##*/}" ] && blk=/dev/${c##*/}
        done
        sleep 0.1
        i=$((i + 1))
    done
    [ -n "$blk" ] || fail "$bdf did not come back as a block device on the nvme driver"
}

probe=/usr/bin/nvme-pcie-probe
if [ -x $probe ]; then
    bind_vfio
    offset=1048576
    step $probe "$dev" --expect /tmp/pattern --saved /tmp/ours --offset $offset
    bind_nvme
    size=$(wc -c </tmp/ours)
    step dd if="$blk" of=/tmp/theirs bs=512 skip=$((offset / 512)) count=$((size / 512)) iflag=direct
    cmp /tmp/ours /tmp/theirs || fail "the kernel reads different data than the probe wrote"
    log "PASS: kernel nvme driver reads what the user-space driver wrote ($size bytes)"
    # Bound to the kernel driver again: refused in one line, nothing unbound.
    out=$($probe "$dev" 2>&1) && fail "probe on a device bound to nvme succeeded: $out"
    echo "$out"
    expect_contains "$out" "bound to the nvme driver, not vfio-pci" "refusal of a kernel-bound device"
    [ "$(echo "$out" | wc -l)" -eq 1 ] || fail "the refusal is not one line: $out"
    [ -b "$blk" ] || fail "$blk vanished after the refused probe"
    log "PASS: user-space driver refuses a controller bound to the nvme driver"
fi

targetd=/usr/bin/nvmeof-targetd
if [ -x $targetd ]; then
    nqn=nqn.2026-11.io.nvmeof-direct:pcie
    port=${TARGET_PORT:-4420}
    tlog=/tmp/nvmeof-targetd.log
    # Still on the nvme driver: the daemon refuses the namespace in one line.
    out=$($targetd --listen "tcp://127.0.0.1:$port" --subsystem $nqn --namespace "pcie:$bdf" 2>&1) &&
        fail "nvmeof-targetd started on a kernel-bound controller: $out"
    echo "$out" | tail -n 1
    expect_contains "$out" "bound to the nvme driver, not vfio-pci" "nvmeof-targetd refusal"
    bind_vfio
    step modprobe nvme_tcp
    NVMEOF_LOG=info $targetd --listen "tcp://127.0.0.1:$port" --subsystem $nqn \
        --namespace "pcie:$bdf" --reactors 2 >$tlog 2>&1 &
    tpid=$!
    i=0
    until grep -q "nvmeof-targetd ready" $tlog; do
        kill -0 $tpid 2>/dev/null || { cat $tlog; fail "nvmeof-targetd exited during start"; }
        i=$((i + 1))
        [ $i -lt 300 ] || { cat $tlog; fail "nvmeof-targetd did not become ready"; }
        sleep 0.1
    done
    step nvme connect -t tcp -a 127.0.0.1 -s "$port" -n $nqn
    ns=$(nvme_wait_ns $nqn 1) || fail "namespace 1 of $nqn did not appear"
    out=$(nvme id-ns "$ns") || fail "nvme id-ns failed"
    echo "$out" | grep -E '^(nsze|ncap)'
    expect_contains "$out" "nsze    : 0x20000" "namespace size (64 MiB of 512-byte blocks)"
    fio_verify "$ns" "${FIO_SIZE:-4M}"
    fio_throughput "$ns" write 8M 128k 8
    fio_throughput "$ns" read 8M 128k 8
    step nvme disconnect -n $nqn
    kill -TERM $tpid
    wait $tpid
    rc=$?
    grep -E "NVMe PCIe namespace opened|ERROR|WARN" $tlog
    [ "$rc" -eq 0 ] || { cat $tlog; fail "nvmeof-targetd exited with $rc"; }
    # After the daemon shut the controller down, the kernel driver takes it back.
    bind_nvme
    log "PASS: kernel NVMe/TCP host -> nvmeof-targetd -> pcie:$bdf (fio verify)"
fi
bench=/usr/bin/nvmeof-bench
if [ -x $bench ]; then
    # The load generator over the same function: das reads through the pcie: backend, tcp
    # through its in-process target serving that backend to its own NVMe/TCP initiator; every
    # read verified against the prefilled pattern. Correctness only: the device is emulated.
    bind_vfio
    cat >/tmp/pcie-bench.toml <<EOF
[global]
modes = ["das", "tcp"]
backend = "pcie:$bdf"
size = "8M"
runtime = "${BENCH_RUNTIME:-1s}"
ramp_time = "0s"
verify = true

[[job]]
name = "4k-randread"
rw = "randread"
bs = "4k"
iodepth = 8

[[job]]
name = "128k-read"
rw = "read"
bs = "128k"
iodepth = 4
EOF
    step $bench /tmp/pcie-bench.toml
    bind_nvme
    log "PASS: nvmeof-bench das and tcp over pcie:$bdf (verified reads)"
fi
# No program given: leave the function on vfio-pci for whatever runs next.
[ -x $probe ] || [ -x $targetd ] || [ -x $bench ] || bind_vfio
log "PASS: emulated NVMe PCIe controller"
