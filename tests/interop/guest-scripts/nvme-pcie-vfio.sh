#!/bin/sh
# QEMU's emulated NVMe PCIe controller (guest.sh --nvme-disk FILE): the kernel nvme driver sees
# it (nvme list, id-ctrl, a data round trip), then it is unbound and handed to vfio-pci behind
# the emulated Intel IOMMU, which is where a userspace NVMe driver takes over.
#
#   truncate -s 64M /tmp/nvme.img
#   tests/interop/guest.sh run --nvme-disk /tmp/nvme.img tests/interop/guest-scripts/nvme-pcie-vfio.sh
#
# Environment: VFIO_BIND (1: bind to vfio-pci at the end; 0: leave it on the nvme driver).
# Prints "VFIO-GROUP <pci address> /dev/vfio/<group>" for a program run after it.
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

if [ "${VFIO_BIND:-1}" = 1 ]; then
    bdf=$(readlink /sys/class/nvme/nvme0/device)
    bdf=${bdf##*/}
    dev=/sys/bus/pci/devices/$bdf
    [ -e /sys/kernel/iommu_groups/0 ] || fail "no IOMMU groups (intel_iommu=on missing?)"
    step modprobe vfio_pci
    echo "$bdf" >"$dev/driver/unbind" || fail "cannot unbind $bdf from nvme"
    echo vfio-pci >"$dev/driver_override"
    echo "$bdf" >/sys/bus/pci/drivers_probe
    drv=$(readlink "$dev/driver")
    [ "${drv##*/}" = vfio-pci ] || fail "$bdf is bound to '${drv##*/}', not vfio-pci"
    group=$(readlink "$dev/iommu_group")
    group=${group##*/}
    [ -c "/dev/vfio/$group" ] || fail "/dev/vfio/$group missing"
    echo "VFIO-GROUP $bdf /dev/vfio/$group"
fi
log "PASS: emulated NVMe PCIe controller"
