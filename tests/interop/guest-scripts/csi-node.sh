#!/bin/sh
# The CSI driver nvmeof-csi (Controller and Node services) in the guest, against an
# nvmeof-targetd on the host (10.0.2.2) with its remote control API: the csi_flow example
# drives one volume through create, publish, stage (nvme connect, mke2fs, mount), publish,
# write, expand, unstage/restage with the data checked, unpublish, unstage and delete.
#
# Files: /csi/csi.toml (controller configuration), /csi/ca.pem, /csi/csi.pem, /csi/csi.key.
# Environment: REMOTE (the target's remote control address, 10.0.2.2:PORT).
# shellcheck source=../guest-lib/interop.sh
. /usr/lib/interop/interop.sh

[ -n "${REMOTE:-}" ] || fail "REMOTE is not set"
hostnqn=$(cat /etc/nvme/hostnqn)
nvmeof-csi --endpoint unix:///run/csi.sock --controller-config /csi/csi.toml --node \
    --host-nqn "$hostnqn" 2>/tmp/csi.log &
i=0
while [ ! -S /run/csi.sock ]; do
    i=$((i + 1))
    [ $i -lt 200 ] || { cat /tmp/csi.log; fail "nvmeof-csi did not start"; }
    sleep 0.1
done
if ! csi_flow unix:///run/csi.sock "$REMOTE" /csi/ca.pem /csi/csi.pem /csi/csi.key; then
    cat /tmp/csi.log
    fail "CSI volume lifecycle"
fi
grep -q panicked /tmp/csi.log && { cat /tmp/csi.log; fail "nvmeof-csi panicked"; }
log "PASS: nvmeof-csi in the guest"
