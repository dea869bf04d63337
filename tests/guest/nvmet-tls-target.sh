#!/bin/sh
# The Linux 6.12 kernel NVMe/TCP target (nvmet) on a port that requires TLS 1.3 (addr_tsas
# tls1.3), for an initiator outside the guest (tests/tests/kernel_target_tls.rs): the host's
# configured PSK goes into the .nvme keyring with `nvme check-tls-key --insert`, tlshd does the
# target's handshakes; prints NVMET-READY and serves until `guest.sh stop`, then prints the
# tlshd and kernel logs.
#
# Environment: NVMET_NQN, TLS_HOST (the only host allowed), TLS_PSK (its NVMeTLSkey-1 key).
. /usr/lib/interop/interop.sh

[ -n "$NVMET_NQN" ] && [ -n "$TLS_HOST" ] && [ -n "$TLS_PSK" ] ||
    fail "NVMET_NQN, TLS_HOST and TLS_PSK are required"
grep -q '^nvmet_tcp ' /proc/modules || step modprobe nvmet_tcp
step nvme check-tls-key --hostnqn="$TLS_HOST" --subsysnqn="$NVMET_NQN" --keydata="$TLS_PSK" --insert
grep -F "$NVMET_NQN" /proc/keys || fail "the PSK is not in a keyring"

tlshd_start

nvmet_subsystem "$NVMET_NQN" "$TLS_HOST"
nvmet_namespace "$NVMET_NQN" 1 "$(nvmet_backing file 32 1)"
nvmet_port 1 tcp 0.0.0.0 4420
echo tls1.3 >"$NVMET_CFS/ports/1/addr_tsas" || fail "cannot require TLS 1.3 on port 1"
log "port 1: addr_tsas $(cat "$NVMET_CFS/ports/1/addr_tsas"), addr_treq $(cat "$NVMET_CFS/ports/1/addr_treq")"
nvmet_link 1 "$NVMET_NQN"
serve_until_stop NVMET-READY

tlshd_stop
echo "--- target log"
dmesg | grep -E 'nvmet|nvme' || true
nvmet_clear
log "target stopped"
