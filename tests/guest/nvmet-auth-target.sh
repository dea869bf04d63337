#!/bin/sh
# The Linux kernel NVMe/TCP target (nvmet) with DH-HMAC-CHAP for one host, for an initiator
# outside the guest (tests/tests/kernel_target_auth.rs): configures the subsystem with
# nvmet_from_env, gives the host its keys in configfs, prints NVMET-READY and serves until
# `guest.sh stop`, then prints what nvmet logged.
#
# Environment: NVMET_NQN, NVMET_NS_SIZE_MB, NVMET_BACKEND (see nvmet_from_env); AUTH_HOST (the
# only host allowed), AUTH_KEY (its DHHC-1 secret), AUTH_CTRL_KEY (optional: the controller's),
# AUTH_HASH (e.g. hmac(sha512)), AUTH_DHGROUP (e.g. ffdhe2048).
. /usr/lib/interop/interop.sh

[ -n "$AUTH_HOST" ] && [ -n "$AUTH_KEY" ] || fail "AUTH_HOST and AUTH_KEY are required"
NVMET_ALLOW_HOSTS=$AUTH_HOST
nvmet_from_env
h=$NVMET_CFS/hosts/$AUTH_HOST
[ -e "$h/dhchap_key" ] || fail "this kernel's nvmet has no DH-HMAC-CHAP (no $h/dhchap_key)"
echo "$AUTH_KEY" >"$h/dhchap_key" || fail "cannot set dhchap_key"
[ -z "${AUTH_CTRL_KEY:-}" ] || echo "$AUTH_CTRL_KEY" >"$h/dhchap_ctrl_key" || fail "cannot set dhchap_ctrl_key"
[ -z "${AUTH_HASH:-}" ] || echo "$AUTH_HASH" >"$h/dhchap_hash" || fail "cannot set dhchap_hash"
[ -z "${AUTH_DHGROUP:-}" ] || echo "$AUTH_DHGROUP" >"$h/dhchap_dhgroup" || fail "cannot set dhchap_dhgroup"
log "nvmet: $AUTH_HOST authenticates with $(cat "$h/dhchap_hash") $(cat "$h/dhchap_dhgroup")"
serve_until_stop NVMET-READY

echo "--- target log"
dmesg | grep -E 'nvmet|nvme' || true
nvmet_clear
log "target stopped"
