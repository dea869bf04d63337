#!/bin/sh
# The CSI driver nvmeof-csi (Controller and Node services) in the guest, against an
# nvmeof-targetd on the host (10.0.2.2) with its remote control API: the csi_flow example
# drives one volume through create, publish, stage (nvme connect, mke2fs, mount), publish,
# write, expand, unstage/restage with the data checked, unpublish, unstage and delete. With
# /usr/bin/csi-sanity in the guest (the test adds it when $CSI_SANITY names a build), csi-sanity
# then runs every spec, the Node service's included.
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
# csi-sanity, when the test put a build of it in the guest: every spec the driver's
# capabilities reach, the Node service's included, on the kernel host.
if [ -x /usr/bin/csi-sanity ]; then
    mkdir -p /tmp/sanity
    if csi-sanity --csi.endpoint=/run/csi.sock --csi.stagingdir=/tmp/sanity/staging \
        --csi.mountdir=/tmp/sanity/mount --csi.testvolumesize=16777216 \
        --csi.testvolumeexpandsize=33554432 --ginkgo.no-color >/tmp/sanity.log 2>&1; then
        grep -E "^Ran [0-9]+ of|Passed" /tmp/sanity.log
        log "PASS: csi-sanity in the guest"
    else
        tail -n 80 /tmp/sanity.log
        tail -n 40 /tmp/csi.log
        fail "csi-sanity in the guest"
    fi
fi
grep -q panicked /tmp/csi.log && { cat /tmp/csi.log; fail "nvmeof-csi panicked"; }
log "PASS: nvmeof-csi in the guest"
