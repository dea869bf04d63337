#!/bin/sh
# Kernel NVMe-oF target (nvmet) for a peer outside the guest: configures one subsystem from the
# environment, prints the ready marker, serves until `guest.sh stop`, then prints what the
# target logged and tears the configuration down.
#
#   pidfile=$(tests/interop/guest.sh start --ready-marker NVMET-READY \
#       --hostfwd 14420:4420 --env NVMET_NQN=nqn.2014-08.org.nvmexpress:test \
#       tests/interop/guest-scripts/nvmet-target.sh)
#   ... connect to 127.0.0.1:14420 (NVMe/TCP) ...
#   tests/interop/guest.sh stop "$pidfile"
#
# Environment: NVMET_TRTYPE (tcp|rdma), NVMET_TRADDR (default 0.0.0.0 for tcp), NVMET_PORT
# (4420), NVMET_NQN, NVMET_NS_COUNT, NVMET_NS_SIZE_MB, NVMET_BACKEND (file|brd|null_blk),
# NVMET_ALLOW_HOSTS, NVMET_MODEL, NVMET_SERIAL, NVMET_INLINE_DATA_SIZE (see nvmet_from_env in
# /usr/lib/interop/interop.sh); READY_MARKER (default NVMET-READY). For rdma the guest needs
# --with-rdma; Soft-RoCE is set up on eth0 first.
# shellcheck source=../guest-lib/interop.sh
. /usr/lib/interop/interop.sh

if [ "${NVMET_TRTYPE:-tcp}" = rdma ]; then
    step modprobe crc32_generic
    step modprobe rdma_rxe
    step rdma link add rxe0 type rxe netdev eth0
fi

nvmet_from_env
serve_until_stop "${READY_MARKER:-NVMET-READY}"

echo "--- target log"
dmesg | grep -E 'nvmet|nvme' || true
nvmet_clear
log "target stopped"
